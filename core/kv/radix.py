"""Radix prefix cache: token prefixes -> KV pages, shared across requests.

Page-granular: every edge covers whole pages, so a hit hands out pages a request can use as they
are, and a prefix that ends inside a page matches only the whole pages before it. The tree holds
one pool reference on every page it stores, so a page outlives the request that computed it.
Nodes on the path of a running request are locked and never evicted; unlocked leaves go least
recently used first, by an explicit access counter (deterministic, unlike wall-clock time).

With window pages (window.py), the node where a stored prefix ends also holds the windows of the
pages within reach of that end, and a match ends only where every such window is there: a hit
restores every component, or is honestly shorter. A node's windows can be let go alone when
window pages run short (the node then stays, for longer hits through it).
"""

from __future__ import annotations

import enum
import heapq
from dataclasses import dataclass, field

from .pages import PagePool
from .window import WindowPool


@dataclass
class RadixStats:
    """Token counts as vLLM reports them (prefix_cache_queries / prefix_cache_hits), plus calls."""

    queries: int = 0
    hits: int = 0
    match_calls: int = 0
    hit_calls: int = 0


class Tier(enum.Enum):
    """Where a cached node's KV lives. Only the GPU tier exists yet; host memory and shared storage
    come with the hierarchical cache, which keeps a node (and its prefix) while any tier holds it."""

    GPU = "gpu"
    HOST = "host"
    STORAGE = "storage"


class _Node:
    __slots__ = ("key", "pages", "children", "parent", "lock_ref", "last_access", "uid", "window", "tiers")

    def __init__(self, key: tuple[int, ...], pages: list[int], parent: _Node | None, uid: int) -> None:
        self.key = key  # tokens of the edge from the parent: len(pages) * page_size of them
        self.pages = pages
        self.children: dict[tuple[int, ...], _Node] = {}  # keyed by the child's first page of tokens
        self.parent = parent
        self.lock_ref = 0
        self.last_access = 0
        self.uid = uid  # creation order: breaks LRU ties deterministically
        self.window: list[int] | None = None  # pages whose windows this node's end holds
        self.tiers = {Tier.GPU}  # on the GPU tier: ``pages`` are pool pages the tree holds a reference on


@dataclass
class PrefixMatch:
    """Pages of the longest cached whole-page prefix; ``node`` is the handle to lock it by."""

    pages: list[int]
    num_tokens: int
    node: _Node = field(repr=False)


class RadixCache:
    """Prefix tree over token ids; match/lock_prefix hand out node handles that lock/unlock take."""

    def __init__(self, pool: PagePool, page_size: int, enabled: bool = True, window: WindowPool | None = None) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.pool = pool
        self.window = window
        self.page_size = page_size
        self.enabled = enabled
        self.stats = RadixStats()
        self._clock = 0
        self._uids = 0
        self._root = self._new_node((), [], None)
        self._cached_pages = 0
        self._evictable_pages = 0

    @property
    def cached_pages(self) -> int:
        return self._cached_pages

    @property
    def evictable_pages(self) -> int:
        """Pages in unlocked nodes: what eviction could release (some may still be held elsewhere)."""
        return self._evictable_pages

    # -- lookup -------------------------------------------------------------------------------

    def match(self, tokens: list[int], record: bool = True) -> PrefixMatch:
        """The longest cached whole-page prefix of ``tokens``; takes no references.

        ``record=False`` leaves the statistics alone, for a caller that may still back out and
        counts the lookup with :meth:`record` once it commits to it.
        """
        if not self.enabled:
            found = PrefixMatch([], 0, self._root)
        else:
            node, pages = self._walk(tokens)
            usable = self._restorable(pages)
            if usable < len(pages):
                node, pages = self._walk(tokens[:usable * self.page_size])
            found = PrefixMatch(pages, len(pages) * self.page_size, node)
        if record:
            self.record(len(tokens), found.num_tokens)
        return found

    def record(self, num_queried: int, num_hit: int) -> None:
        """Count one lookup of ``num_queried`` tokens of which ``num_hit`` were cached."""
        self.stats.queries += num_queried
        self.stats.match_calls += 1
        self.stats.hits += num_hit
        self.stats.hit_calls += num_hit > 0

    def _restorable(self, pages: list[int]) -> int:
        """The most leading pages a hit can take: where every window within reach of its end is kept."""
        if self.window is None:
            return len(pages)
        k = len(pages)
        while k:
            gone = [i for i in range(self._tail_start(k), k) if not self.window.has(pages[i])]
            if not gone:
                break
            k = gone[-1]  # any longer hit still reaches back to that page
        return k

    def _tail_start(self, num_pages: int) -> int:
        return max(0, num_pages * self.page_size - self.window.reach) // self.page_size

    def lock_prefix(self, tokens: list[int]) -> _Node:
        """Lock the node where the cached whole-page prefix of ``tokens`` ends (no statistics)."""
        node = self._walk(tokens)[0] if self.enabled else self._root
        self.lock(node)
        return node

    def _walk(self, tokens: list[int]) -> tuple[_Node, list[int]]:
        """Follow ``tokens`` down whole pages, splitting the last edge where the match ends inside it."""
        self._clock += 1
        ps = self.page_size
        node, pos, pages = self._root, 0, []
        node.last_access = self._clock
        end = len(tokens) // ps * ps
        while pos < end:
            child = node.children.get(tuple(tokens[pos:pos + ps]))
            if child is None:
                break
            n = self._common_pages(child.key, tokens, pos)
            if n < len(child.pages):
                child = self._split(child, n)
            child.last_access = self._clock
            pages.extend(child.pages)
            pos += len(child.key)
            node = child
        return node, pages

    # -- locking ------------------------------------------------------------------------------

    def lock(self, node: _Node) -> None:
        self._check_attached(node)
        n = node
        while n is not None:
            if n.lock_ref == 0:
                self._evictable_pages -= len(n.pages)
            n.lock_ref += 1
            n = n.parent

    def unlock(self, node: _Node) -> None:
        self._check_attached(node)
        n = node
        while n is not None:
            if n.lock_ref == 0:
                raise ValueError("unlock of a node that is not locked")
            n = n.parent
        n = node
        while n is not None:
            n.lock_ref -= 1
            if n.lock_ref == 0:
                self._evictable_pages += len(n.pages)
            n = n.parent

    def _check_attached(self, node: _Node) -> None:
        if node is not self._root and node.parent is None:
            raise ValueError("node was evicted from the cache; its handle is stale")

    # -- insertion ----------------------------------------------------------------------------

    def insert(self, tokens: list[int], pages: list[int]) -> int:
        """Store the whole-page prefix of ``tokens`` on ``pages``; return the tokens already cached.

        Ranges already in the tree keep the tree's pages (the caller still owns and frees its
        own); the tree takes one reference on exactly the pages it newly stores.
        """
        ps = self.page_size
        num_pages = len(tokens) // ps
        if len(pages) < num_pages:
            raise ValueError(f"{len(tokens)} tokens need {num_pages} pages, got {len(pages)}")
        if not self.enabled:
            return 0
        node, held = self._walk(tokens)
        present = len(held)
        if present < num_pages:
            new_pages = list(pages[present:num_pages])
            self.pool.incref(new_pages)
            leaf = self._new_node(tuple(tokens[present * ps:num_pages * ps]), new_pages, node)
            leaf.last_access = self._clock
            node.children[leaf.key[:ps]] = leaf
            self._cached_pages += len(new_pages)
            self._evictable_pages += len(new_pages)
            node, held = leaf, held + new_pages
        self._hold_window(node, held)
        return present * ps

    def _hold_window(self, node: _Node, path_pages: list[int]) -> None:
        """Let the node where a stored prefix ends hold the windows within reach of its end, if all are there."""
        if self.window is None or node.window is not None or not path_pages:
            return
        tail = path_pages[self._tail_start(len(path_pages)):]
        if not self.window.missing(tail):
            self.window.hold(tail)
            node.window = tail

    def release_windows(self, num_window_pages: int) -> bool:
        """Let go of nodes' windows, least recently used first, until that many window pages are
        free; False if they cannot be. Locked nodes too: a running sequence holds the windows it
        reads itself, a node's are only for later hits."""
        if self.window is None:
            return False
        heap = [(n.last_access, n.uid, n) for n in self.nodes() if n.window is not None]
        heapq.heapify(heap)
        while self.window.num_free < num_window_pages and heap:
            node = heapq.heappop(heap)[2]
            self.window.let_go(node.window)
            node.window = None
        return self.window.num_free >= num_window_pages

    def _common_pages(self, key: tuple[int, ...], tokens: list[int], pos: int) -> int:
        """Whole pages shared by an edge ``key`` and ``tokens[pos:]`` (the first page is known equal)."""
        ps = self.page_size
        n = 1
        while (n + 1) * ps <= min(len(key), len(tokens) - pos) and \
                key[n * ps:(n + 1) * ps] == tuple(tokens[pos + n * ps:pos + (n + 1) * ps]):
            n += 1
        return n

    def _split(self, child: _Node, n: int) -> _Node:
        """Cut ``child``'s edge after ``n`` pages; the new upper node is returned (callers touch it).

        ``child`` stays the lower part, so handles to it (and its locks) keep meaning the same prefix.
        """
        ps = self.page_size
        upper = self._new_node(child.key[:n * ps], child.pages[:n], child.parent)
        upper.lock_ref = child.lock_ref
        upper.tiers = set(child.tiers)
        child.parent.children[upper.key[:ps]] = upper
        child.key, child.pages, child.parent = child.key[n * ps:], child.pages[n:], upper
        upper.children[child.key[:ps]] = child
        return upper

    def _new_node(self, key: tuple[int, ...], pages: list[int], parent: _Node | None) -> _Node:
        self._uids += 1
        return _Node(key, pages, parent, self._uids)

    # -- eviction -----------------------------------------------------------------------------

    def evict(self, num_pages: int) -> int:
        """Drop least recently used unlocked leaves until ``num_pages`` pages are actually free.

        A dropped page that a request still references does not count. Returns the pages freed.
        """
        heap = [(n.last_access, n.uid, n) for n in self.nodes() if self._evictable_leaf(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            freed += self._drop(node)
            if self._evictable_leaf(parent):
                heapq.heappush(heap, (parent.last_access, parent.uid, parent))
        return freed

    def reset(self) -> int:
        """Drop every unlocked node, releasing the tree's references; locked paths stay cached.

        Statistics are kept. Returns the pages freed.
        """
        return self.evict(self._cached_pages + 1)

    def _evictable_leaf(self, node: _Node) -> bool:
        return node is not self._root and not node.children and node.lock_ref == 0

    def _drop(self, node: _Node) -> int:
        """Detach a leaf and release its pages; returns how many of them became free."""
        del node.parent.children[node.key[:self.page_size]]
        node.parent = None
        node.tiers.discard(Tier.GPU)
        if node.window is not None:
            self.window.let_go(node.window)
            node.window = None
        self.pool.decref(node.pages)
        freed = sum(self.pool.refcount(p) == 0 for p in set(node.pages))
        self._cached_pages -= len(node.pages)
        self._evictable_pages -= len(node.pages)
        return freed

    def nodes(self):
        """Every node, the root first."""
        stack = [self._root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
