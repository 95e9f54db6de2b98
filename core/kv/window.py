"""Window pages: the per-token components a model needs only near a sequence's end, bounded in memory.

DeepSeek-V4 reads its sliding-window KV and its compressors' open windows only a bounded reach
behind the tokens it computes, so those components live in a pool of their own, far smaller than
the page pool. A page of the page pool gets a window page while someone holds its window: a
running sequence for the pages within reach of its end, the prefix cache for the pages within
reach of the end of a prefix it stores (so a hit there restores every component). The last
holder to let go frees the window page; reads of a page without one are never made.
"""

from __future__ import annotations

from .pages import NULL_PAGE, PagePool
from .storage import KVCache


class WindowPool:
    def __init__(self, num_window_pages: int, kv: KVCache, reach: int) -> None:
        self.pool = PagePool(num_window_pages)
        self.kv = kv
        self.reach = reach  # tokens before a step's first new token whose windows it reads
        self._of = [NULL_PAGE] * kv.num_pages  # page -> its window page

    @property
    def num_free(self) -> int:
        return self.pool.num_free

    def has(self, page: int) -> bool:
        return self._of[page] != NULL_PAGE

    def page_of(self, page: int) -> int:
        """``page``'s window page (the null page where it has none)."""
        return self._of[page]

    def missing(self, pages: list[int]) -> int:
        """How many of ``pages`` have no window page yet (what holding them all would allocate)."""
        return sum(1 for p in set(pages) if self._of[p] == NULL_PAGE)

    def hold(self, pages: list[int]) -> None:
        """One more holder of each page's window, allocated where it has none."""
        if self.missing(pages) > self.pool.num_free:
            raise ValueError(f"{self.missing(pages)} window pages needed, {self.pool.num_free} free")
        for p in pages:
            if self._of[p] == NULL_PAGE:
                self._of[p] = self.pool.alloc(1)[0]
                self.kv.stage_window(p, self._of[p])
            else:
                self.pool.incref([self._of[p]])

    def holders(self, page: int) -> int:
        """How many hold ``page``'s window."""
        w = self._of[page]
        return self.pool.refcount(w) if w != NULL_PAGE else 0

    def let_go(self, pages: list[int]) -> None:
        for p in pages:
            w = self._of[p]
            if w == NULL_PAGE:
                raise ValueError(f"page {p} has no window to let go of")
            self.pool.decref([w])
            if self.pool.refcount(w) == 0:
                self._of[p] = NULL_PAGE
                self.kv.stage_window(p, NULL_PAGE)

    def span(self, first_token: int, end_token: int, page_size: int) -> tuple[int, int]:
        """Page indices [a, b) whose windows a step over tokens first..end-1 needs: back to
        ``reach`` tokens before the page the step starts in."""
        a = max(0, first_token // page_size * page_size - self.reach) // page_size
        return a, -(-end_token // page_size)

    def check_consistency(self, page_pool: PagePool) -> None:
        """Raise AssertionError if a free page keeps a window or the pool's books disagree."""
        self.pool.check_consistency()
        held = [p for p, w in enumerate(self._of) if w != NULL_PAGE]
        stale = [p for p in held if page_pool.refcount(p) == 0]
        if stale:
            raise AssertionError(f"free pages {stale} still have window pages")
        if len(held) != self.pool.num_used:
            raise AssertionError(f"{len(held)} pages have windows but {self.pool.num_used} window pages are used")
