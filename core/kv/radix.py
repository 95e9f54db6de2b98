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

With a lower tier (the hierarchical cache, hierarchy.py) a node records which tiers hold it. The
nodes on the device form a subtree at the root (a device node's parent is on the device); below
them, nodes whose KV is only in the lower tier keep their place in the tree with the keys of
their records (``lower``, and ``lower_window`` for the windows of their end). Evicting a device
leaf (a device node with no device child) demotes it where the lower tier keeps it and drops it,
with everything below it, otherwise; the lower tier's own room is freed from its leaves, least
recently used first. Matching stops at the device; ``lower_path`` tells what lies beyond.
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
    """Where a cached node's KV lives: the device (GPU), the lower tier of the hierarchical cache
    (HOST: host memory); STORAGE (a shared store) is asked live, never recorded in the tree."""

    GPU = "gpu"
    HOST = "host"
    STORAGE = "storage"


class _Node:
    __slots__ = ("key", "pages", "children", "parent", "lock_ref", "last_access", "uid", "window", "tiers",
                 "lower", "lower_window", "hits", "rows")

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
        self.lower: list[str] | None = None  # on the HOST tier: its records' keys, one per page
        self.lower_window: list[str] | None = None  # the records of the windows of its end's pages
        self.hits = 0  # matches through it (selective write-through)
        self.rows = None  # a host copy of a proposer's rows of its first pages, until they are written (hierarchy.py)

    @property
    def on_device(self) -> bool:
        return Tier.GPU in self.tiers


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
        self.lower = None  # the hierarchical cache (hierarchy.KVHierarchy) where one is configured

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
            node, pages, _ = self._walk(tokens)
            usable = self._restorable(pages)
            if usable < len(pages):
                node, pages, _ = self._walk(tokens[:usable * self.page_size])
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

    def tail_pages(self, num_pages: int) -> int:
        """How many of a prefix's last pages (of ``num_pages``) a hit at its end needs the windows of."""
        return num_pages - self._tail_start(num_pages)

    def lock_prefix(self, tokens: list[int]) -> _Node:
        """Lock the node where the cached whole-page prefix of ``tokens`` ends (no statistics)."""
        node = self._walk(tokens)[0] if self.enabled else self._root
        self.lock(node)
        return node

    def lower_path(self, tokens: list[int]) -> tuple[_Node, list[int], list[_Node]]:
        """The device part of the cached prefix of ``tokens`` (its last node and pages) and the nodes
        beyond it that only the lower tier holds, each wholly inside ``tokens``."""
        node, pages, path = self._walk(tokens, lower=True)
        device = [n for n in path if n.on_device]
        return (device[-1] if device else self._root), pages, path[len(device):]

    def _walk(self, tokens: list[int], lower: bool = False) -> tuple[_Node, list[int], list[_Node]]:
        """Follow ``tokens`` down whole pages (through nodes on the device only, unless ``lower``),
        splitting the last edge where the match ends inside it; the last node, the device pages and
        the nodes on the way."""
        self._clock += 1
        ps = self.page_size
        node, pos, pages, path = self._root, 0, [], []
        node.last_access = self._clock
        end = len(tokens) // ps * ps
        while pos < end:
            child = node.children.get(tuple(tokens[pos:pos + ps]))
            if child is None or not (lower or child.on_device):
                break
            n = self._common_pages(child.key, tokens, pos)
            if n * ps < len(child.key):
                child = self._split(child, n)
            child.last_access = self._clock
            pages.extend(child.pages)
            path.append(child)
            pos += len(child.key)
            node = child
        return node, pages, path

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
        node, held, path = self._walk(tokens, lower=True)
        for n in path[len(path) - sum(not n.on_device for n in path):]:  # computed again: on the device once more
            self.promote(n, list(pages[len(held):len(held) + len(n.key) // ps]), adopt=False)
            held += n.pages
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
        if self.lower is not None:
            self.lower.inserted(node)
        return present * ps

    def promote(self, node: _Node, pages: list[int], adopt: bool = True) -> None:
        """A node only the lower tier held is on the device again, on ``pages``: the caller's
        references, with ``adopt``, else the tree takes one of its own."""
        if node.on_device or node.parent is None or not node.parent.on_device and node.parent is not self._root:
            raise ValueError("only a lower-tier node whose parent is on the device can be promoted")
        if len(pages) * self.page_size != len(node.key):
            raise ValueError(f"{len(pages)} pages for an edge of {len(node.key)} tokens")
        if not adopt:
            self.pool.incref(pages)
        node.pages = pages
        node.tiers.add(Tier.GPU)
        self._cached_pages += len(pages)
        if node.lock_ref == 0:
            self._evictable_pages += len(pages)

    def path(self, node: _Node) -> list[_Node]:
        """The nodes from the root's child down to ``node``."""
        out = []
        while node.parent is not None:
            out.append(node)
            node = node.parent
        return out[::-1]

    def prefix(self, node: _Node) -> list[int]:
        """The tokens of the prefix ending at ``node``."""
        return [t for n in self.path(node) for t in n.key]

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
        upper.hits = child.hits
        if child.lower is not None:
            upper.lower, child.lower = child.lower[:n], child.lower[n:]
        if child.rows is not None:
            upper.rows, child.rows = child.rows[:n], child.rows[n:] or None
        child.parent.children[upper.key[:ps]] = upper
        child.key, child.pages, child.parent = child.key[n * ps:], child.pages[n:], upper
        upper.children[child.key[:ps]] = child
        return upper

    def _new_node(self, key: tuple[int, ...], pages: list[int], parent: _Node | None) -> _Node:
        self._uids += 1
        return _Node(key, pages, parent, self._uids)

    # -- eviction ---------------------------------------------------------------------------

    def evict(self, num_pages: int, demote: bool = True) -> int:
        """Take least recently used unlocked device leaves off the device until ``num_pages`` pages
        are actually free: demoted where the lower tier keeps them (and ``demote``), else dropped.

        A dropped page that a request still references does not count. Returns the pages freed.
        """
        heap = [(n.last_access, n.uid, n) for n in self.nodes() if self._evictable_leaf(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            if demote and self.lower is not None and self.lower.keep(node):
                freed += self._release_device(node)
            else:
                freed += self._drop(node)
            if self._evictable_leaf(parent):
                heapq.heappush(heap, (parent.last_access, parent.uid, parent))
        return freed

    def reset(self) -> int:
        """Drop every unlocked node, on the device and below, releasing the tree's references;
        locked paths stay cached (their lower-tier copies go). Statistics are kept. Returns the
        device pages freed."""
        freed = self.evict(self._cached_pages + 1, demote=False)
        self.release_lower(lambda: False)
        return freed

    def _evictable_leaf(self, node: _Node) -> bool:
        return (node is not self._root and node.on_device and node.lock_ref == 0
                and not any(c.on_device for c in node.children.values()))

    def _release_device(self, node: _Node) -> int:
        """Let go of a node's device pages and windows (it stays, in the lower tier, or is being
        dropped); how many pages became free."""
        node.tiers.discard(Tier.GPU)
        if node.window is not None:
            self.window.let_go(node.window)
            node.window = None
        self.pool.decref(node.pages)
        freed = sum(self.pool.refcount(p) == 0 for p in set(node.pages))
        self._cached_pages -= len(node.pages)
        self._evictable_pages -= len(node.pages)
        node.pages = []
        return freed

    def drop(self, node: _Node) -> int:
        """Drop an unlocked node and everything below it, on every tier; the device pages freed."""
        if node.lock_ref:
            raise ValueError("a locked node cannot be dropped")
        self._check_attached(node)
        return self._drop(node)

    def _drop(self, node: _Node) -> int:
        """Detach an unlocked node and everything below it (only the lower tier holds those),
        releasing its pages and every lower-tier record; how many pages became free."""
        del node.parent.children[node.key[:self.page_size]]
        node.parent = None
        stack = list(node.children.values())
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            self._release_lower(n)
            n.parent = None
        self._release_lower(node)
        return self._release_device(node) if node.on_device else 0

    # -- the lower tier -----------------------------------------------------------------------

    def release_lower(self, room, keep: _Node | None = None) -> bool:
        """Let go of lower-tier copies, least recently used first, from nodes with no lower-tier
        child, until ``room()`` holds; never a locked node's, nor ``keep``'s or those below it (the
        longer prefixes its records serve). A node only the lower tier held leaves the tree.
        Whether ``room()`` holds."""
        heap = [(n.last_access, n.uid, n) for n in self.nodes() if self._lower_leaf(n, keep)]
        heapq.heapify(heap)
        while not room() and heap:
            node = heapq.heappop(heap)[2]
            parent = node.parent
            self._release_lower(node)
            if not node.on_device:
                del parent.children[node.key[:self.page_size]]
                node.parent = None
            if self._lower_leaf(parent, keep):
                heapq.heappush(heap, (parent.last_access, parent.uid, parent))
        return room()

    def _lower_leaf(self, node: _Node, keep: _Node | None) -> bool:
        return (node is not self._root and Tier.HOST in node.tiers and node.lock_ref == 0
                and not any(Tier.HOST in c.tiers for c in node.children.values())
                and (keep is None or keep not in self.path(node)))

    def _release_lower(self, node: _Node) -> None:
        if self.lower is not None and Tier.HOST in node.tiers:
            self.lower.forget(node)
        node.tiers.discard(Tier.HOST)
        node.lower = node.lower_window = None

    def attach_lower(self, tokens: list[int], keys: list[str], window_keys: list[str] | None) -> _Node:
        """A node only the lower tier holds, for the ``len(keys)`` pages of ``tokens`` past the prefix
        the tree knows (records fetched from storage): its records' keys and its end's windows'."""
        node, _, path = self._walk(tokens, lower=True)
        start = sum(len(n.key) for n in path)
        end = start + len(keys) * self.page_size
        if end > len(tokens) // self.page_size * self.page_size:
            raise ValueError(f"{len(keys)} records past {start} tokens, beyond the {len(tokens)} given")
        leaf = self._new_node(tuple(tokens[start:end]), [], node)
        leaf.tiers = {Tier.HOST}
        leaf.lower, leaf.lower_window = list(keys), window_keys
        leaf.last_access = self._clock
        node.children[leaf.key[:self.page_size]] = leaf
        return leaf

    def lower_nodes(self):
        """Every node the lower tier holds."""
        return (n for n in self.nodes() if Tier.HOST in n.tiers)

    def nodes(self):
        """Every node, the root first."""
        stack = [self._root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
