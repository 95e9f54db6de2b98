"""What the engine returns: typed per-step deltas from the core, cumulative outputs for users.

``EngineCoreOutput`` is what one step changed for one request; it crosses the process boundary as
it is (msgpack through msgspec), so the core's outputs and the wire's are one type. ``RequestOutput``
is what ``LLM.generate`` returns, shaped like vLLM's so callers can switch; output_processor.py
builds it from the deltas.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

Logprobs = list[dict[int, float]]


class CompletionDelta(msgspec.Struct, array_like=True):
    """What one report adds to one of a request's ``n`` completions."""

    index: int
    token_ids: list[int]  # generated since the last report
    logprobs: Logprobs | None  # per new token: {token id: logprob}, the chosen one included
    finish_reason: str | None  # set once, in the report that ends it
    stop_reason: int | str | None


class EngineCoreOutput(msgspec.Struct):
    """What one step changed for one request."""

    request_id: str
    completions: list[CompletionDelta]
    finished: bool
    prompt_logprobs: list[dict[int, float] | None] | None = None  # once, with the first output
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    queue_time: float | None = None  # with the last output: seconds from arrival to first scheduling


@dataclass
class CompletionOutput:
    """One of the ``n`` completions of a request."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: Logprobs | None = None  # per generated token: {token_id: logprob}, the chosen one included
    finish_reason: str | None = None  # "stop", "length", "abort" or None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[dict[int, float] | None] | None = None  # None for the first prompt token
    finished: bool = False
    num_cached_tokens: int = 0
