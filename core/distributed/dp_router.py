"""Where a new request goes under data-parallel attention (dp_attention.py): each rank has a radix
cache of its own, so a prompt served by the rank that already holds its prefix computes only the
rest, while on any other rank it computes the whole prompt.

``prefix`` (the default) sends a request to the rank whose cache holds its longest prefix, in whole
pages, as SGLang's cache-aware routing does, among the ranks whose outstanding requests are within
``load_balance_threshold`` of the least loaded one's (a prefix every request shares, such as a system
prompt, would otherwise draw every request to one rank); ties, and requests that no rank caches, go
to the least loaded rank, the lowest first. ``shortest_queue`` is that last rule alone, and
``round_robin`` takes the ranks in turn.

Rank 0 does not read the ranks' caches: it keeps for each rank the pages of the prompts it sent
there, as a chain of page hashes (a page's hash covers every token before it, so equal hashes mean
equal prefixes), most recently used last and no more of them than a rank has KV pages. A rank's
cache evicts its least recently used pages too, so the two stay close without a word between them.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict

METHODS = ("prefix", "shortest_queue", "round_robin")


def page_hashes(ids: list[int], page_size: int) -> list[int]:
    """The hash of each whole page of ``ids`` together with every page before it."""
    out, h = [], 0
    for start in range(0, len(ids) - page_size + 1, page_size):
        h = hash((h, tuple(ids[start:start + page_size])))
        out.append(h)
    return out


class CachedPrefixes:
    """The pages one rank was sent, least recently used first, at most ``capacity`` of them."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.pages: OrderedDict[int, None] = OrderedDict()

    def match(self, hashes: list[int]) -> int:
        """How many leading pages of a prompt this rank holds."""
        n = 0
        while n < len(hashes) and hashes[n] in self.pages:
            n += 1
        return n

    def insert(self, hashes: list[int]) -> None:
        for h in hashes:
            self.pages[h] = None
            self.pages.move_to_end(h)
        while len(self.pages) > self.capacity:
            self.pages.popitem(last=False)


class DataParallelRouter:
    def __init__(self, ranks: int, method: str, threshold: int, page_size: int, pages_per_rank: int) -> None:
        self.ranks = ranks
        self.method = method
        self.threshold = threshold
        self.page_size = page_size
        self.cached = [CachedPrefixes(pages_per_rank) for _ in range(ranks)]
        self._turns = itertools.cycle(range(ranks))

    def place(self, ids: list[int], load: list[int]) -> int:
        """The rank for a new prompt ``ids``, given each rank's outstanding requests."""
        if self.method == "round_robin":
            return next(self._turns)
        if self.method == "shortest_queue":
            return min(range(self.ranks), key=lambda r: (load[r], r))
        hashes = page_hashes(ids, self.page_size)
        least = min(load)
        rank = min((r for r in range(self.ranks) if load[r] <= least + self.threshold),
                   key=lambda r: (-self.cached[r].match(hashes), load[r], r))
        self.cached[rank].insert(hashes)
        return rank
