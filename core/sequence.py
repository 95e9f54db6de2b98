"""A sequence: one of a request's ``n`` completions (its KV is the KV manager's, core/kv/manager.py)."""

from __future__ import annotations

import enum
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from .sampling_params import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # queued; holds no pages (new, or preempted and to be recomputed)
    RUNNING = "running"  # holds pages; prefilling in chunks or decoding
    FORK_PENDING = "fork_pending"  # a sibling of n > 1 waiting for the first sequence's prompt
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None = None
    output_token_ids: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0  # tokens whose KV is written
    num_cached: int = 0  # of those, how many came from the prefix cache at admission
    num_pending: int = 0  # tokens drawn on the device whose step the host has not processed yet
    slot: int = 0  # its row in the token table while it runs (core/token_table.py); 0: none
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_logprobs_requested: int = 0  # prompt positions whose logprobs are computed (maybe still in flight)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    max_output: int = sys.maxsize  # output tokens that end it by length (max_tokens, or a full context)
    ending_ids: frozenset[int] = frozenset()  # ids that end it once min_tokens are out: stop ids, EOS unless ignored
    grammar: Any = None  # structured outputs: its grammar matcher, fed the tokens on the host (core/structured/)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def in_flight(self) -> bool:
        """Its latest token is drawn on the device and not on the host yet (in the token table at ``slot``)."""
        return self.num_pending > 0

    @property
    def num_output(self) -> int:
        """Output tokens drawn, those in flight counted."""
        return len(self.output_token_ids) + self.num_pending

    @property
    def tokens(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, lo: int, hi: int) -> list[int]:
        """tokens[lo:hi] without building the whole list (decode reads one token per step)."""
        n = len(self.prompt_token_ids)
        if lo >= n:
            return self.output_token_ids[lo - n: hi - n]
        if hi <= n:
            return self.prompt_token_ids[lo:hi]
        return self.prompt_token_ids[lo:] + self.output_token_ids[: hi - n]

    def reaches_length(self, num_more: int = 0) -> bool:
        """Its tokens and ``num_more`` drawn after them end it by length."""
        return len(self.output_token_ids) + num_more >= self.max_output

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    @property
    def in_prefill(self) -> bool:
        """Still computing tokens it already knows (its prompt, or everything after a preemption)."""
        return self.num_computed < len(self.prompt_token_ids) + len(self.output_token_ids) - 1

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None and self.index == 0
