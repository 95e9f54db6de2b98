"""Speculative decoding's totals, counted as vLLM's spec_decode metrics count them.

A msgspec Struct with no torch, so the engine process sends it to the API process as it is
(server/wire.py) and /metrics renders it (server/metrics.py).
"""

from __future__ import annotations

import msgspec


class SpecCounters(msgspec.Struct):
    """Since start-up: verified steps of a sequence with drafts, their drafts, the drafts kept, and
    per draft position how often it was kept."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = msgspec.field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        """Drafts kept over drafts verified (0 before any)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verified sequence gains per step: its kept drafts and the target's own (0 before any)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def plus(self, other: SpecCounters) -> SpecCounters:
        """The totals of two engines together (data-parallel attention's ranks)."""
        return SpecCounters(self.num_drafts + other.num_drafts, self.num_draft_tokens + other.num_draft_tokens,
                            self.num_accepted_tokens + other.num_accepted_tokens,
                            [a + b for a, b in zip(self.accepted_per_position, other.accepted_per_position)])

    def snapshot(self) -> SpecCounters:
        return SpecCounters(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                            list(self.accepted_per_position))
