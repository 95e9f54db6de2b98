"""The KV manager: the one owner of KV state.

It owns the page pool, the radix prefix cache, the window pages (window.py) and every sequence's
pages, and answers the scheduler in sequence terms: match a prefix, allocate for a step, commit
what a step computed, roll back, free, fork, evict, export and import pages. Nothing else touches
the pools, so the invariants (every reference accounted for, no locked prefix evicted, a window
held exactly where someone reads it) are kept and checked in one place.

A sequence's state is its page table (a list, and a row of the host page table that batches
gather, page_table.py), the tokens committed to it (written and confirmed: only
those ever reach the prefix cache), the radix node locked on its behalf, and the page indices
whose windows it holds. The manager reads a sequence's ``seq_id`` and tokens; it never writes it.

Rolling back needs no undo record, DeepSeek-V4's state included: every component is kept per
position (the sliding-window KV and the compressors' per-token projections, which are the open
windows' partial state, in the token's slot of its page's window page; a pooled entry in the page
of its window's last token), so a step never writes a slot of an earlier position, and a slot past
the new end (a token's, or an entry whose window closes there) is written again by the step that
brings that position before any query reads it. What a rollback must keep is the window pages
within reach of the shorter end: a sequence holds them ``max_rollback`` tokens further back than
its steps read, and never takes up again a window it let go (its page may have been reused).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..families.cache_tier import CacheTier
from .hicache_stats import HiCacheStats, snapshot
from .hierarchy import KVHierarchy
from .page_rows import PageRows
from .page_table import PageTable
from .pages import PagePool
from .radix import RadixCache, RadixStats, Tier
from .storage import KVCache
from .window import WindowPool

if TYPE_CHECKING:
    from ..sequence import Sequence
    from .radix import _Node


@dataclass
class SeqKV:
    """One sequence's KV state (read it, never change it, outside the manager)."""

    pages: list[int] = field(default_factory=list)  # its page table
    num_tokens: int = 0  # tokens committed: their KV is written and confirmed
    node: _Node | None = field(default=None, repr=False)  # radix node locked on its behalf
    window: tuple[int, int] = (0, 0)  # page indices [a, b) whose windows it holds
    published: bool = False  # its prompt's full pages are in the prefix cache
    row: int = 0  # its row of the host page table


@dataclass(frozen=True)
class KVStats:
    """Pages and prefix-cache counters; tokens counted as vLLM does (queries and hits)."""

    num_usable: int
    num_free: int
    num_cached: int  # pages the prefix cache holds
    num_evictable: int  # of those, in unlocked entries
    num_window_used: int
    prefix_queries: int
    prefix_hits: int
    num_window_usable: int = 0

    @property
    def num_used(self) -> int:
        return self.num_usable - self.num_free

    @property
    def usage(self) -> float:
        """Pages held by requests over usable pages (cached but evictable pages count as free)."""
        return max(0, self.num_used - self.num_evictable) / self.num_usable


class KVManager:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True,
                 kv: KVCache | None = None, num_window_pages: int = 0, window_reach: int = 0,
                 max_rollback: int = 0, max_seq_len: int | None = None) -> None:
        """``num_window_pages`` > 0 keeps windows (the windowed layers of ``kv``, ``window_reach`` tokens).
        ``max_rollback``: how many committed tokens back from its end a sequence keeps the windows a
        rollback returns to, over any number of steps (a rollback within the last step needs none).
        ``max_seq_len``: the most tokens a sequence holds, which sizes the page table's rows (by
        default a sequence may hold every page)."""
        if num_window_pages and kv is None:
            raise ValueError("window pages need the KV cache whose window table they fill (kv)")
        if max_rollback < 0:
            raise ValueError(f"max_rollback must be >= 0, got {max_rollback}")
        self.page_size = page_size
        self.max_rollback = max_rollback
        self.pool = PagePool(num_pages)
        self.window = WindowPool(num_window_pages, kv, window_reach) if num_window_pages else None
        self.radix = RadixCache(self.pool, page_size, enabled=enable_prefix_caching, window=self.window)
        self.page_table = PageTable(self._pages_for(max_seq_len) if max_seq_len else num_pages - 1)
        self._seqs: dict[int, SeqKV] = {}
        self._copies: list[tuple[int, int]] = []  # (src, dst) pages to copy before the next forward
        self.lower: KVHierarchy | None = None  # the hierarchical cache's tiers below the device

    def attach_lower(self, tier: CacheTier, policy: str, model_key: str, kv: KVCache,
                     rows: PageRows | None = None) -> KVHierarchy:
        """Keep the prefix cache's pages in ``tier`` below the device too (hierarchy.py), written by
        ``policy``, with a proposer's ``rows`` of them; ``model_key`` seeds the pages' content keys."""
        self.lower = KVHierarchy(self.radix, self.pool, kv, self.window, tier, policy, model_key, rows)
        return self.lower

    @property
    def num_pages(self) -> int:
        return self.pool.num_pages

    @property
    def window_reach(self) -> int:
        return self.window.reach if self.window is not None else 0

    def state(self, seq: Sequence) -> SeqKV | None:
        return self._seqs.get(seq.seq_id)

    def pages(self, seq: Sequence) -> list[int]:
        """The sequence's page table (the manager's own list: read it, never change it)."""
        st = self._seqs.get(seq.seq_id)
        return st.pages if st is not None else []

    def _pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # -- a sequence's life --------------------------------------------------------------------

    def match_prefix(self, seq: Sequence, tokens: list[int]) -> int:
        """Start a sequence that holds nothing from the longest cached whole-page prefix of
        ``tokens`` (its pages shared, its radix node locked, the windows within reach of its end
        held); the tokens it covers. Lookups are counted by :meth:`record_lookup`."""
        self._check_new(seq)
        if self.lower is not None and self.radix.enabled:
            self.lower.load(tokens, self._reserve)
        match = self.radix.match(tokens, record=False)
        if match.num_tokens == 0:
            return 0
        if self.lower is not None:
            self.lower.matched(match.node)
        self.radix.lock(match.node)
        self.pool.incref(match.pages)
        st = self._start(seq, list(match.pages), match.num_tokens, match.node)
        if self.window is not None:  # a match keeps every window within reach of its end
            st.window = self.window.span(match.num_tokens, match.num_tokens, self.page_size)
            self.window.hold(st.pages[slice(*st.window)])
        return match.num_tokens

    def prefetch(self, tokens: list[int]) -> None:
        """A request that will look up ``tokens`` arrived: a storage tier may start reading them."""
        if self.lower is not None and self.radix.enabled:
            self.lower.prefetch(tokens)

    def record_lookup(self, num_queried: int, num_hit: int) -> None:
        """Count one prefix-cache lookup (once per admitted request, however often it was matched)."""
        self.radix.record(num_queried, num_hit)

    def allocate(self, seq: Sequence, num_new: int) -> SeqKV | None:
        """Pages for ``num_new`` tokens after the committed ones and the windows a step over them
        reads, evicting cached prefixes (then their windows) as needed; the sequence's state. None
        where the pool cannot give that much; pages taken so far stay (the next attempt needs them
        too). A decode inside its last page (most steps) takes nothing and changes nothing."""
        st = self._seqs.get(seq.seq_id)
        if st is None:
            st = self._start(seq, [], 0)
        end = st.num_tokens + num_new
        need = -(-end // self.page_size) - len(st.pages)
        if need > 0:
            if not self._reserve(need):
                return None
            new = self.pool.alloc(need)
            self.page_table.write(st.row, len(st.pages), new)
            st.pages += new
        if self.window is not None and not self._move_windows(st, st.num_tokens, end, retain=True):
            return None
        return st

    def commit(self, seq: Sequence, num_tokens: int) -> None:
        """The KV of the first ``num_tokens`` tokens is written. Once the prompt is, its full pages
        go to the prefix cache (so concurrent requests share them) and its node is locked."""
        st = self._seqs[seq.seq_id]
        if num_tokens > len(st.pages) * self.page_size:
            raise ValueError(f"commit of {num_tokens} tokens on {len(st.pages)} pages of {self.page_size}")
        st.num_tokens = num_tokens
        if not st.published and self.radix.enabled and num_tokens >= len(seq.prompt_token_ids):
            prompt = seq.prompt_token_ids
            self._cache(prompt, st.pages)
            node = self.radix.lock_prefix(prompt)
            if st.node is not None:
                self.radix.unlock(st.node)
            st.node, st.published = node, True

    def rollback(self, seq: Sequence, num_tokens: int) -> None:
        """Forget every token from ``num_tokens`` on (rejected speculative tokens): pages past the new
        end are freed, the windows held become those of the shorter end, and the prefix cache never
        sees the forgotten tokens; the sequence then reads what it would have, had they never been
        computed. The windows the shorter end reads must still be held (a rollback within the last
        step's tokens, or of at most ``max_rollback``), and a page it leaves partly filled must be its own."""
        st = self._seqs[seq.seq_id]
        if not 0 <= num_tokens <= st.num_tokens:
            raise ValueError(f"rollback to {num_tokens} tokens; {st.num_tokens} are committed")
        keep = self._pages_for(num_tokens)
        if num_tokens % self.page_size and self.pool.refcount(st.pages[keep - 1]) > 1:
            raise ValueError(f"rollback to {num_tokens} tokens would rewrite shared page {st.pages[keep - 1]}")
        if self.window is not None:
            a, b = self.window.span(num_tokens, num_tokens, self.page_size)
            if a < st.window[0]:
                raise ValueError(f"rollback to {num_tokens} tokens reaches back to page {a}, whose window "
                                 f"is no longer held (held from page {st.window[0]})")
            self._move_windows(st, num_tokens, num_tokens, retain=True)
        self.pool.decref(st.pages[keep:])
        self.page_table.clear(st.row, keep, len(st.pages))
        del st.pages[keep:]
        st.num_tokens = num_tokens

    def free(self, seq: Sequence, cache: bool = True) -> None:
        """Give back everything the sequence holds; with ``cache`` its committed full pages go to
        the prefix cache first."""
        st = self._seqs.pop(seq.seq_id, None)
        if st is None:
            return
        self.page_table.release(st.row, len(st.pages))
        if st.pages:
            if cache and self.radix.enabled:
                self._cache(seq.tokens[:st.num_tokens], st.pages)
            if self.window is not None:
                self.window.let_go(st.pages[slice(*st.window)])
            self.pool.decref(st.pages)
        if st.node is not None:
            self.radix.unlock(st.node)

    def fork(self, parent: Sequence, child: Sequence, num_tokens: int) -> bool:
        """Start ``child`` (holding nothing) from the parent's first ``num_tokens`` tokens: their
        full pages are shared and a partial last page is copied (see :meth:`take_page_copies`),
        since each writes its own tokens there. False, with the child holding nothing, where pages
        or window pages run short."""
        self._check_new(child)
        p = self._seqs[parent.seq_id]
        full = num_tokens // self.page_size
        st = self._start(child, p.pages[:full], num_tokens)
        self.pool.incref(st.pages)
        copy = None
        if num_tokens % self.page_size:
            if not self._reserve(1):
                self.free(child, cache=False)
                return False
            copy = (p.pages[full], self.pool.alloc(1)[0])
            self.page_table.write(st.row, full, [copy[1]])
            st.pages.append(copy[1])
        if not self._move_windows(st, num_tokens, num_tokens):  # the copy reaches the window page too
            self.free(child, cache=False)
            return False
        if copy is not None:
            self._copies.append(copy)
        if p.node is not None:
            self.radix.lock(p.node)
            st.node, st.published = p.node, p.published
        return True

    def take_page_copies(self) -> list[tuple[int, int]]:
        """(src, dst) page copies the next forward must apply first; the list is handed over."""
        copies, self._copies = self._copies, []
        return copies

    @property
    def has_page_copies(self) -> bool:
        return bool(self._copies)

    # -- pages for another engine (prefill/decode disaggregation) ------------------------------

    def export_pages(self, seq: Sequence) -> list[int]:
        """The pages holding the sequence's committed tokens, in order, for the caller to read
        (windowed layers: through the KV cache's window table, for the pages within reach of the end)."""
        st = self._seqs[seq.seq_id]
        return st.pages[:self._pages_for(st.num_tokens)]

    def import_pages(self, seq: Sequence, tokens: list[int]) -> int | None:
        """Pages for the KV of ``tokens``, computed elsewhere, registered to ``seq`` (holding
        nothing) as committed: the longest cached whole-page prefix shared from the prefix cache as
        :meth:`match_prefix` shares it, fresh pages for the rest, and the windows within reach of
        the end. The tokens the cache held: the caller writes the KV of the rest into the pages
        past them before the sequence's next step, whose commit publishes the prompt. None
        (holding nothing) where pages run short."""
        hit = self.match_prefix(seq, tokens)
        st = self._seqs.get(seq.seq_id) or self._start(seq, [], 0)
        need = self._pages_for(len(tokens)) - len(st.pages)
        if not self._reserve(need):
            self.free(seq, cache=False)
            return None
        new = self.pool.alloc(need)
        self.page_table.write(st.row, len(st.pages), new)
        st.pages += new
        st.num_tokens = len(tokens)
        if not self._move_windows(st, len(tokens), len(tokens)):
            self.free(seq, cache=False)
            return None
        return hit

    # -- the cache as a whole -----------------------------------------------------------------

    def evict(self, num_pages: int) -> int:
        """Drop least recently used unlocked cached prefixes until ``num_pages`` pages are free; the pages freed."""
        return self.radix.evict(num_pages)

    def reset_prefix_cache(self) -> int:
        """Drop every unlocked cached prefix; the pages freed."""
        return self.radix.reset()

    def reset_stats(self) -> None:
        """Zero the prefix-cache counters (after the start-up warm-up, which is no one's traffic)."""
        self.radix.stats = RadixStats()
        if self.lower is not None:
            self.lower.reset_stats()

    def stats(self) -> KVStats:
        window_used = self.window.pool.num_used if self.window is not None else 0
        window_usable = self.window.pool.num_usable if self.window is not None else 0
        return KVStats(self.pool.num_usable, self.pool.num_free, self.radix.cached_pages, self.radix.evictable_pages,
                       window_used, self.radix.stats.queries, self.radix.stats.hits, window_usable)

    def hicache_stats(self) -> HiCacheStats | None:
        """The hierarchical cache's totals and tier usage (None without one)."""
        return snapshot(self.lower, self.stats()) if self.lower is not None else None

    def check_consistency(self) -> None:
        """Raise AssertionError unless every page reference, lock and window hold is accounted for
        by a sequence or a cached prefix."""
        self.pool.check_consistency()
        refs: Counter[int] = Counter()
        locks: Counter[int] = Counter()
        windows: Counter[int] = Counter()
        rows = set()
        for st in self._seqs.values():
            row = self.page_table.array[st.row]
            if st.row == 0 or st.row in rows or row[:len(st.pages)].tolist() != st.pages or row[len(st.pages):].any():
                raise AssertionError(f"page table row {st.row} is not the page list {st.pages}")
            rows.add(st.row)
            refs.update(st.pages)
            windows.update(st.pages[slice(*st.window)])
            if len(st.pages) < self._pages_for(st.num_tokens):
                raise AssertionError(f"{st.num_tokens} tokens committed on {len(st.pages)} pages")
            n = st.node
            while n is not None:
                locks[id(n)] += 1
                n = n.parent
        for node in self.radix.nodes():
            if node.parent is not None and not node.on_device and (
                    node.pages or Tier.HOST not in node.tiers or any(c.on_device for c in node.children.values())):
                raise AssertionError(f"a cached node off the device holds pages {node.pages}, is on tiers "
                                     f"{node.tiers} or has a child on the device")
            refs.update(node.pages)
            windows.update(node.window or [])
            if node.lock_ref != locks[id(node)]:
                raise AssertionError(f"a node locked {node.lock_ref} time(s) has {locks[id(node)]} locker(s)")
        wrong = [p for p in range(1, self.pool.num_pages) if self.pool.refcount(p) != refs[p]]
        if wrong:
            raise AssertionError(f"pages {wrong[:10]} have refcounts {[self.pool.refcount(p) for p in wrong[:10]]} "
                                 f"but {[refs[p] for p in wrong[:10]]} holder(s)")
        if self.lower is not None:
            self.lower.check_consistency()
        if self.window is not None:
            self.window.check_consistency(self.pool)
            wrong = [p for p in range(1, self.pool.num_pages) if self.window.holders(p) != windows[p]]
            if wrong:
                raise AssertionError(f"windows of pages {wrong[:10]} are held {[self.window.holders(p) for p in wrong[:10]]}"
                                     f" time(s) but have {[windows[p] for p in wrong[:10]]} holder(s)")

    # -- inside -------------------------------------------------------------------------------

    def _start(self, seq: Sequence, pages: list[int], num_tokens: int, node: _Node | None = None) -> SeqKV:
        """The state of a sequence that held nothing, now holding ``pages`` (references already taken)."""
        st = self._seqs[seq.seq_id] = SeqKV(pages, num_tokens, node, row=self.page_table.assign(pages))
        return st

    def _check_new(self, seq: Sequence) -> None:
        if seq.seq_id in self._seqs:
            raise ValueError(f"sequence {seq.seq_id} already holds KV state")

    def _cache(self, tokens: list[int], pages: list[int]) -> None:
        """Store ``tokens`` in the prefix cache. The same tokens sent again match all but the last
        (a step computes at least one), which for a page-aligned end is one page short: the
        windows within reach of that shorter end are kept too, or such a hit would find none."""
        self.radix.insert(tokens, pages)
        if self.window is not None and tokens and len(tokens) % self.page_size == 0:
            self.radix.insert(tokens[:-1], pages)

    def _reserve(self, num_pages: int) -> bool:
        """Make ``num_pages`` pages free, evicting cached prefixes if need be."""
        if self.pool.num_free < num_pages:
            self.radix.evict(num_pages - self.pool.num_free)
        return self.pool.num_free >= num_pages

    def _move_windows(self, st: SeqKV, first: int, end: int, retain: bool = False) -> bool:
        """Hold exactly the windows a step over tokens first..end-1 reads (its pages exist), letting
        cached prefixes' windows go if window pages run short; False (nothing changed) if still short.
        With ``retain``, also those a rollback of ``max_rollback`` tokens from ``end`` returns to,
        where still held."""
        if self.window is None:
            return True
        a, b = self.window.span(first, end, self.page_size)
        a0, b0 = st.window
        if retain:
            a = max(min(a, self.window.span(max(0, end - self.max_rollback), end, self.page_size)[0]), a0)
        if (a, b) == (a0, b0):
            return True
        gain = [st.pages[i] for i in range(a, b) if not a0 <= i < b0]
        need = self.window.missing(gain)
        if need > self.window.num_free and not self.radix.release_windows(need):
            return False
        self.window.hold(gain)
        self.window.let_go([st.pages[i] for i in range(a0, b0) if not a <= i < b])
        st.window = (a, b)
        return True
