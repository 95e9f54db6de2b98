"""Page ids with reference counts: who may write a KV page and when it can be reused.

A page is shared by every holder of a reference (running sequences, forked siblings, the prefix
cache) and returns to the free list only when the last one lets go. Page 0 is the null page:
padded page-table entries and padded slots point at it, so it is never handed out.
"""

from __future__ import annotations

import heapq
from collections import Counter

NULL_PAGE = 0


class OutOfPages(RuntimeError):
    """Fewer free pages than asked for; nothing was allocated."""


class PagePool:
    """Allocator of page ids 1..num_pages-1.

    Allocation hands out the lowest free ids first (a min-heap), so the order is deterministic
    and a freed page is reused before higher, never-touched ones.
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages < 2:
            raise ValueError(f"a page pool needs at least 2 pages (the null page and one usable), got {num_pages}")
        self.num_pages = num_pages
        self._refcount = [0] * num_pages
        self._free = list(range(1, num_pages))  # sorted, hence already a heap

    @property
    def num_usable(self) -> int:
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_usable - self.num_free

    def alloc(self, n: int) -> list[int]:
        """``n`` fresh pages, each with one reference."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} pages, {len(self._free)} free of {self.num_usable}")
        pages = [heapq.heappop(self._free) for _ in range(n)]
        for p in pages:
            self._refcount[p] = 1
        return pages

    def incref(self, pages: list[int]) -> None:
        """One more reference on each page (a page listed twice gains two); pages must be in use."""
        for p in pages:
            self._check_id(p)
            if self._refcount[p] == 0:
                raise ValueError(f"incref of free page {p}")
        for p in pages:
            self._refcount[p] += 1

    def decref(self, pages: list[int]) -> None:
        """Drop one reference per listing; a page left with none is free again.

        Checked before anything changes, so a double free raises and leaves the pool as it was.
        """
        for p, n in Counter(pages).items():
            self._check_id(p)
            if self._refcount[p] < n:
                raise ValueError(f"decref of page {p} {n} time(s) but it has {self._refcount[p]} reference(s)")
        for p in pages:
            self._refcount[p] -= 1
            if self._refcount[p] == 0:
                heapq.heappush(self._free, p)

    def refcount(self, page: int) -> int:
        if not 0 <= page < self.num_pages:
            raise ValueError(f"page {page} is outside 0..{self.num_pages - 1}")
        return self._refcount[page]

    def check_consistency(self) -> None:
        """Raise AssertionError unless the free list holds exactly the unreferenced usable pages."""
        if self._refcount[NULL_PAGE] != 0:
            raise AssertionError(f"null page has refcount {self._refcount[NULL_PAGE]}")
        if len(set(self._free)) != len(self._free):
            raise AssertionError("a page is on the free list twice")
        negative = [p for p, c in enumerate(self._refcount) if c < 0]
        if negative:
            raise AssertionError(f"negative refcounts on pages {negative}")
        unreferenced = {p for p in range(1, self.num_pages) if self._refcount[p] == 0}
        if set(self._free) != unreferenced:
            raise AssertionError(f"free list {sorted(self._free)} != unreferenced pages {sorted(unreferenced)}")

    def _check_id(self, page: int) -> None:
        if page == NULL_PAGE:
            raise ValueError("the null page (0) is never allocated, referenced or freed")
        if not 0 < page < self.num_pages:
            raise ValueError(f"page {page} is outside 1..{self.num_pages - 1}")
