"""What ``LLM.generate`` returns, shaped like vLLM's so callers can switch."""

from __future__ import annotations

from dataclasses import dataclass

Logprobs = list[dict[int, float]]


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
