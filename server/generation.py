"""One prompt's run through the engine, as the API process follows it.

The engine sends token ids; here they become text with the same incremental detokenizer
``LLM.generate`` uses, so the server's text equals the library's. Stop strings are found here,
off the engine loop; the completion that reaches one is ended in the engine by a message. Latency
and token metrics are observed here, where the client's view of time is.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

from ..core.detokenizer import IncrementalDetokenizer
from ..core.sampling_params import SamplingParams
from ..core.tokenizer import Tokenizer
from .engine_client import EngineClient
from .metrics import ServerMetrics
from .wire import RequestDelta, SeqDelta, engine_params


@dataclass
class Completion:
    """One of a prompt's ``n`` completions: tokens, text and logprobs so far."""

    index: int
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    last_token_time: float | None = None

    def apply(self, d: SeqDelta) -> tuple[str, int]:
        """Take a delta; return the new text and how many tokens it consumed (after a stop string, none)."""
        if self.finish_reason is not None:
            return "", 0
        pieces, used = [], 0
        for i, tok in enumerate(d.token_ids):
            self.token_ids.append(tok)
            if self.logprobs is not None and d.logprobs is not None:
                self.logprobs.append(d.logprobs[i])
            pieces.append(self.detok.add(tok))
            used += 1
            if self.detok.finished_by_stop is not None:
                self.finish_reason, self.stop_reason = "stop", self.detok.finished_by_stop
                break
        else:
            if d.finish_reason is not None:
                pieces.append(self.detok.flush())
                self.finish_reason, self.stop_reason = d.finish_reason, d.stop_reason
                if self.detok.finished_by_stop is not None:  # text held back until the end held a stop string
                    self.finish_reason, self.stop_reason = "stop", self.detok.finished_by_stop
        new = "".join(pieces)
        self.text += new
        return new, used


@dataclass
class Update:
    """What one engine message changed for one completion."""

    completion: Completion
    text: str
    first_token: int  # index into completion.token_ids of the first token this update added
    num_tokens: int
    finished: bool


class PromptRun:
    """One engine request: a prompt with ``n`` completions."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams,
                 prompt_text: str | None = None) -> None:
        self.request_id = f"req-{uuid.uuid4().hex}"
        self.prompt_token_ids = prompt_token_ids
        self.prompt_text = prompt_text
        self.params = params
        self.completions = [
            Completion(i, IncrementalDetokenizer(tokenizer, prompt_token_ids, params),
                       logprobs=[] if params.logprobs is not None else None)
            for i in range(params.n)
        ]
        self.prompt_logprobs: list[dict[int, float] | None] | None = None
        self.num_cached_tokens = 0
        self._first_token_seen = False

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.completions)

    async def run(self, client: EngineClient, metrics: ServerMetrics, arrival: float) -> AsyncIterator[Update]:
        """Updates until every completion ended; leaving early aborts the request in the engine."""
        metrics.prompt_tokens += len(self.prompt_token_ids)
        try:
            async for delta in client.generate(self.request_id, self.prompt_token_ids, engine_params(self.params)):
                for update in self._take(delta, client, metrics, arrival):
                    yield update
            for c in self.completions:  # the engine ended the request without a final word for it
                if c.finish_reason is None:
                    c.finish_reason = "abort"
                    metrics.finished("abort")
                    yield Update(c, "", len(c.token_ids), 0, True)
        finally:
            for c in self.completions:  # the caller left early: these were aborted
                if c.finish_reason is None:
                    c.finish_reason = "abort"
                    metrics.finished("abort")
            metrics.e2e.observe(time.monotonic() - arrival)

    def _take(self, delta: RequestDelta, client: EngineClient, metrics: ServerMetrics, arrival: float) -> list[Update]:
        now = time.monotonic()
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        self.num_cached_tokens = delta.num_cached_tokens
        if delta.queue_time is not None:
            metrics.queue_time.observe(delta.queue_time)
        updates = []
        for sd in delta.seqs:
            c = self.completions[sd.index]
            was_done = c.finish_reason is not None
            start = len(c.token_ids)
            text, used = c.apply(sd)
            if used:
                if not self._first_token_seen:
                    metrics.ttft.observe(now - arrival)
                    self._first_token_seen = True
                gaps = used if c.last_token_time is not None else used - 1
                per = (now - c.last_token_time) / gaps if gaps and c.last_token_time is not None else 0.0
                for _ in range(gaps):
                    metrics.itl.observe(per)
                c.last_token_time = now
                metrics.generation_tokens += used
            done = c.finish_reason is not None and not was_done
            if done:
                metrics.finished(c.finish_reason)
                if sd.finish_reason is None:  # a stop string: end it in the engine too
                    client.finish_sequence(self.request_id, c.index, c.stop_reason)
            if used or done or text:
                updates.append(Update(c, text, start, used, done))
        return updates
