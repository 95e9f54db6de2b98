"""A request as the engine tracks it: its sequences, their text, and its timings."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .detokenizer import IncrementalDetokenizer
from .outputs import CompletionOutput, RequestOutput
from .sampling_params import SamplingParams
from .sequence import Sequence


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    detokenizers: list[IncrementalDetokenizer] | None  # None: the caller detokenizes
    stream: bool = True  # report every change, not only the end
    arrival_time: float = field(default_factory=time.monotonic)

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    def output(self) -> RequestOutput:
        """The cumulative state so far (what ``LLM.generate`` returns once finished)."""
        completions = [
            CompletionOutput(
                index=s.index,
                text=self.detokenizers[s.index].output_text if self.detokenizers is not None else "",
                token_ids=list(s.output_token_ids),
                logprobs=list(s.logprobs) if s.logprobs is not None else None,
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
            )
            for s in self.seqs
        ]
        first = self.seqs[0]
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=list(self.prompt_token_ids),
            outputs=completions,
            prompt_logprobs=list(first.prompt_logprobs) if first.prompt_logprobs is not None else None,
            finished=self.finished,
            num_cached_tokens=first.num_cached,
        )
