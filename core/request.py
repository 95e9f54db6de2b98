"""A request as the engine core tracks it: its sequences, its timings, and what it has reported."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .outputs import CompletionDelta, EngineCoreOutput
from .sampling_params import SamplingParams
from .sequence import SeqStatus, Sequence


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    arrival_time: float = field(default_factory=time.monotonic)
    reported: list[int] = field(init=False)  # per sequence: tokens reported, -1 once its end was
    num_open: int = field(init=False)  # sequences whose end is not reported yet
    prompt_logprobs_pending: bool = field(init=False)  # asked for, not reported yet

    def __post_init__(self) -> None:
        self.reported = [0] * len(self.seqs)
        self.num_open = len(self.seqs)
        self.prompt_logprobs_pending = self.seqs[0].prompt_logprobs is not None

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    def take_output(self) -> EngineCoreOutput | None:
        """What changed since the last report (None: nothing): new tokens and logprobs per sequence,
        each end once, the prompt logprobs once with the first tokens."""
        deltas = []
        reported = self.reported
        for s in self.seqs:
            k = reported[s.index]
            if k < 0:  # its end is reported
                continue
            new = s.output_token_ids[k:]
            if s.status is SeqStatus.FINISHED:
                reported[s.index] = -1
                self.num_open -= 1
            elif new:
                reported[s.index] = k + len(new)
            else:
                continue
            deltas.append(CompletionDelta(s.index, new, s.logprobs[k:] if s.logprobs is not None else None,
                                          s.finish_reason, s.stop_reason))
        first = self.seqs[0]
        prompt_lps = None
        if self.prompt_logprobs_pending and (first.output_token_ids or first.is_finished):
            prompt_lps = list(first.prompt_logprobs)
            self.prompt_logprobs_pending = False
        finished = self.num_open == 0
        if not deltas and not finished:
            return None
        queue_time = None
        if finished and first.first_scheduled_time is not None:
            queue_time = first.first_scheduled_time - self.arrival_time
        return EngineCoreOutput(self.request_id, deltas, finished, prompt_lps, first.num_cached, queue_time)
