"""One prompt's run through the engine, as the API process follows it.

The engine sends its core's typed outputs (token ids); here they are read by the same
``RequestState`` that ``LLMEngine`` uses (core/output_processor.py), so the server's text equals
the library's and stop strings are decided in that one place, off the engine loop; a completion
that reaches one is ended in the engine by a message. Latency and token metrics are observed here,
where the client's view of time is.
"""

from __future__ import annotations

import time
import uuid
from typing import AsyncIterator

from ..core.output_processor import RequestState, Update
from ..core.outputs import EngineCoreOutput
from ..core.sampling_params import SamplingParams
from ..core.tokenizer import Tokenizer
from .engine_client import EngineClient
from .metrics import ServerMetrics

class PromptRun(RequestState):
    """One engine request: a prompt with ``n`` completions."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams,
                 prompt_text: str | None = None) -> None:
        super().__init__(f"req-{uuid.uuid4().hex}", tokenizer, prompt_token_ids, params, prompt_text)
        self._last_token_time: dict[int, float] = {}  # per completion
        self._first_token_seen = False

    async def run(self, client: EngineClient, metrics: ServerMetrics, arrival: float) -> AsyncIterator[Update]:
        """Updates until every completion ended; leaving early aborts the request in the engine."""
        metrics.prompt_tokens += len(self.prompt_token_ids)
        try:
            async for out in client.generate(self.request_id, self.prompt_token_ids, self.params):
                for update in self._take(out, client, metrics, arrival):
                    yield update
            for c in self.completions:  # the engine ended the request without a final word for it
                if c.finish_reason is None:
                    c.finish_reason = "abort"
                    metrics.finished("abort")
                    yield Update(c, "", len(c.token_ids), 0, True, False)
        finally:
            for c in self.completions:  # the caller left early: these were aborted
                if c.finish_reason is None:
                    c.finish_reason = "abort"
                    metrics.finished("abort")
            metrics.e2e.observe(time.monotonic() - arrival)

    def _take(self, out: EngineCoreOutput, client: EngineClient, metrics: ServerMetrics,
              arrival: float) -> list[Update]:
        now = time.monotonic()
        if out.queue_time is not None:
            metrics.queue_time.observe(out.queue_time)
        updates = self.apply(out)
        for u in updates:
            c, used = u.completion, u.num_tokens
            if used:
                if not self._first_token_seen:
                    metrics.ttft.observe(now - arrival)
                    self._first_token_seen = True
                last = self._last_token_time.get(c.index)
                gaps = used if last is not None else used - 1
                per = (now - last) / gaps if gaps and last is not None else 0.0
                for _ in range(gaps):
                    metrics.itl.observe(per)
                self._last_token_time[c.index] = now
                metrics.generation_tokens += used
            if u.finished:
                metrics.finished(c.finish_reason)
            if u.stop_string:  # end it in the engine too
                client.finish_sequence(self.request_id, c.index, c.stop_reason)
        return updates
