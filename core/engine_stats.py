"""What the engine reports to gauges and metrics: a snapshot of its state and its monotonic totals."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .disagg.counters import TransferCounters
from .kv.hicache_stats import HiCacheStats
from .spec.counters import SpecCounters

if TYPE_CHECKING:
    from .distributed.messages import RankStats


@dataclass
class EngineStats:
    """A snapshot for gauges: what is running, waiting and held right now, and the totals so far."""

    num_running: int
    num_waiting: int
    kv_usage: float  # pages held by requests / usable pages (cached but evictable pages are free)
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    spec: SpecCounters | None = None  # speculative decoding's totals, where it is on
    hicache: HiCacheStats | None = None  # the hierarchical cache's, where it is on
    kv_transfer: TransferCounters | None = None  # a decode engine's KV transfers (core/disagg)

    def add_ranks(self, ranks: list[RankStats]) -> None:
        """Fold in the other data-parallel ranks' snapshots (from after their last step); KV usage
        becomes the mean over every rank."""
        for r in ranks:
            self.num_running += r.num_running
            self.num_waiting += r.num_waiting
            self.kv_usage += r.kv_usage
            self.prefix_cache_queries += r.prefix_cache_queries
            self.prefix_cache_hits += r.prefix_cache_hits
            self.num_preemptions += r.num_preemptions
            if r.spec is not None:
                self.spec = self.spec.plus(r.spec)
        self.kv_usage /= len(ranks) + 1


@dataclass
class EngineCounters:
    """Monotonic totals for metrics; finished requests are counted by finish reason."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)
