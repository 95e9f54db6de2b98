"""RadixCache: page-granular prefix sharing, locks, LRU eviction, checked against a simple model."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from engine.core.kv.pages import OutOfPages, PagePool
from engine.core.kv.radix import RadixCache


def tree_contents(radix: RadixCache) -> dict[tuple[int, ...], int]:
    """Every cached whole-page prefix -> the page holding its last page of tokens; checks the shape."""
    ps, out = radix.page_size, {}
    stack = [(radix._root, ())]
    while stack:
        node, prefix = stack.pop()
        for first, child in node.children.items():
            assert child.parent is node and child.key[:ps] == first
            assert child.key and len(child.key) == len(child.pages) * ps
            assert child.lock_ref >= 0 and node.lock_ref >= child.lock_ref
            for i, page in enumerate(child.pages):
                out[prefix + child.key[:(i + 1) * ps]] = page
            stack.append((child, prefix + child.key))
    return out


def fill(pool: PagePool, radix: RadixCache, tokens: list[int]) -> list[int]:
    """Cache ``tokens`` as a finished request would: fresh pages, insert, then drop its own references."""
    pages = pool.alloc(-(-len(tokens) // radix.page_size))
    radix.insert(tokens, pages)
    pool.decref(pages)
    return pages


def test_shared_prefix_reuses_pages():
    pool = PagePool(32)
    radix = RadixCache(pool, page_size=4)
    a = list(range(12))
    pages = fill(pool, radix, a)
    assert radix.cached_pages == 3 and pool.num_used == 3

    b = a[:8] + [99] * 5
    m = radix.match(b)
    assert (m.pages, m.num_tokens) == (pages[:2], 8)
    assert (radix.stats.queries, radix.stats.hits, radix.stats.match_calls, radix.stats.hit_calls) == (13, 8, 1, 1)

    own = pool.alloc(2)  # b's pages past the hit
    assert radix.insert(b, m.pages + own) == 8
    assert radix.cached_pages == 4 and pool.refcount(own[0]) == 2
    assert pool.refcount(own[1]) == 1  # b's partial last page is not cached
    pool.decref(own)
    assert radix.match(b[:12]).pages == pages[:2] + own[:1]
    assert radix.match([7, 7, 7, 7]).num_tokens == 0
    assert (radix.stats.match_calls, radix.stats.hit_calls) == (3, 2)
    pool.check_consistency()


def test_matches_and_inserts_are_page_granular():
    pool = PagePool(32)
    radix = RadixCache(pool, page_size=4)
    a = list(range(12))
    pages = fill(pool, radix, a)
    assert radix.match(a[:10]).pages == pages[:2]
    assert radix.match(a[:10]).num_tokens == 8
    assert radix.match(a[:3]).num_tokens == 0
    assert radix.match(a[:5] + [50, 51, 52]).pages == pages[:1]  # diverges inside page 2

    mine = pool.alloc(3)
    assert radix.insert(a[:10], mine) == 8  # nothing new: the tree keeps its own pages
    assert radix.cached_pages == 3 and [pool.refcount(p) for p in mine] == [1, 1, 1]

    # diverging inside page 2 splits the edge after page 1, never inside a page
    c = a[:6] + [60] * 6
    assert radix.insert(c, mine) == 4
    assert radix.cached_pages == 5
    assert radix.match(c).pages == pages[:1] + mine[1:]
    assert radix.match(a).pages == pages
    assert all(len(k) % 4 == 0 for k in tree_contents(radix))
    pool.decref(mine)
    pool.check_consistency()


def test_insert_needs_a_page_per_whole_page_of_tokens():
    pool = PagePool(8)
    radix = RadixCache(pool, page_size=2)
    with pytest.raises(ValueError):
        radix.insert([1, 2, 3, 4, 5], pool.alloc(1))
    assert radix.insert([1, 2, 3], pool.alloc(1)) == 0  # the partial page needs no page
    assert radix.cached_pages == 1


def test_eviction_never_frees_a_locked_page():
    pool = PagePool(16)
    radix = RadixCache(pool, page_size=2)
    kept = fill(pool, radix, [1, 1, 1, 1])
    other = fill(pool, radix, [2, 2, 2, 2])
    m = radix.match([1, 1, 1, 1, 3])
    radix.lock(m.node)
    assert radix.evictable_pages == 2
    assert radix.evict(100) == 2
    assert [pool.refcount(p) for p in other] == [0, 0]
    assert [pool.refcount(p) for p in kept] == [1, 1]
    assert radix.evict(100) == 0 and radix.match([1, 1, 1, 1]).pages == kept
    radix.unlock(m.node)
    assert radix.evictable_pages == 2
    assert radix.evict(1) == 2  # whole leaves go
    assert pool.num_used == 0 and radix.cached_pages == 0
    pool.check_consistency()


def test_lock_on_a_deeper_node_protects_its_ancestors():
    pool = PagePool(16)
    radix = RadixCache(pool, page_size=1)
    fill(pool, radix, [1, 2])
    fill(pool, radix, [1, 2, 3, 4])  # node [1, 2] with child [3, 4]
    deep = radix.match([1, 2, 3, 4]).node
    radix.lock(deep)
    assert radix.evictable_pages == 0 and radix.evict(10) == 0
    radix.unlock(deep)
    radix.lock(radix.match([1, 2]).node)
    assert radix.evict(10) == 2 and tree_contents(radix).keys() == {(1,), (1, 2)}


def test_lru_order_is_honoured():
    pool = PagePool(16)
    radix = RadixCache(pool, page_size=2)
    x, y, z = [1, 1, 1, 1], [2, 2], [3, 3, 3, 3]
    px, py, pz = (fill(pool, radix, t) for t in (x, y, z))
    radix.match(x)  # x is now the most recently used, y the least
    assert radix.evict(1) == 1 and [pool.refcount(p) for p in py] == [0]
    assert radix.match(x).num_tokens == 4 and radix.match(z[:2]).num_tokens == 2
    # the match of z[:2] split z after its first page; the touched upper part outlives the lower one
    assert radix.evict(1) == 1 and pool.refcount(pz[1]) == 0 and pool.refcount(pz[0]) == 1
    assert radix.evict(2) == 2 and [pool.refcount(p) for p in px] == [0, 0]
    assert tree_contents(radix) == {(3, 3): pz[0]}


def test_evict_counts_only_pages_that_become_free():
    pool = PagePool(16)
    radix = RadixCache(pool, page_size=2)
    held = pool.alloc(2)
    radix.insert([1, 1, 1, 1], held)  # a running request still holds these
    free_later = fill(pool, radix, [2, 2, 2, 2])
    radix.match([2, 2, 2, 2])  # so the held leaf is the least recently used
    assert radix.evict(1) == 2  # dropping the held leaf freed nothing; the next leaf had to go
    assert radix.cached_pages == 0
    assert [pool.refcount(p) for p in held] == [1, 1] and [pool.refcount(p) for p in free_later] == [0, 0]
    pool.decref(held)
    assert pool.num_used == 0


def test_split_keeps_locks_on_the_original_handle():
    pool = PagePool(16)
    radix = RadixCache(pool, page_size=2)
    fill(pool, radix, [1, 2, 3, 4, 5, 6])
    node = radix.match([1, 2, 3, 4, 5, 6]).node
    radix.lock(node)
    fill(pool, radix, [1, 2, 9, 9])  # splits the locked edge after one page
    assert radix.evictable_pages == 1
    assert radix.evict(10) == 1
    radix.unlock(node)
    assert radix.evictable_pages == 3
    with pytest.raises(ValueError):
        radix.unlock(node)


def test_unlock_below_zero_and_stale_handles_raise():
    pool = PagePool(8)
    radix = RadixCache(pool, page_size=1)
    fill(pool, radix, [1, 2])
    m = radix.match([1, 2])
    with pytest.raises(ValueError):
        radix.unlock(m.node)
    radix.evict(2)
    with pytest.raises(ValueError):
        radix.lock(m.node)


def test_lock_prefix_and_reset():
    pool = PagePool(16)
    radix = RadixCache(pool, page_size=2)
    fill(pool, radix, [1, 1, 1, 1])
    fill(pool, radix, [1, 1, 2, 2])
    node = radix.lock_prefix([1, 1, 1, 1, 7])
    assert radix.stats.match_calls == 0
    assert radix.reset() == 1  # [2, 2] goes, the locked path stays
    assert tree_contents(radix).keys() == {(1, 1), (1, 1, 1, 1)}
    radix.unlock(node)
    assert radix.reset() == 2 and radix.cached_pages == 0 and pool.num_used == 0


def test_disabled_cache_stores_nothing_but_counts_queries():
    pool = PagePool(8)
    radix = RadixCache(pool, page_size=2, enabled=False)
    pages = pool.alloc(2)
    assert radix.insert([1, 2, 3, 4], pages) == 0
    m = radix.match([1, 2, 3, 4, 5])
    assert (m.pages, m.num_tokens) == ([], 0)
    assert (radix.stats.queries, radix.stats.hits, radix.stats.match_calls) == (5, 0, 1)
    assert radix.cached_pages == 0 and [pool.refcount(p) for p in pages] == [1, 1]
    radix.lock(m.node)
    radix.unlock(m.node)


# -- randomized, against a reference model ------------------------------------------------------


@dataclass
class Model:
    """Cached page-aligned prefixes -> page, their last access, live locks and page references."""

    page_size: int
    cached: dict[tuple[int, ...], int] = field(default_factory=dict)
    access: dict[tuple[int, ...], int] = field(default_factory=dict)
    locks: list[tuple[int, ...]] = field(default_factory=list)  # prefix each live lock ends at
    refs: dict[int, int] = field(default_factory=dict)  # page -> references (tree + requests)
    clock: int = 0
    queries: int = 0
    hits: int = 0
    hit_calls: int = 0
    match_calls: int = 0

    def prefixes(self, tokens) -> list[tuple[int, ...]]:
        ps = self.page_size
        return [tuple(tokens[:k * ps]) for k in range(1, len(tokens) // ps + 1)]

    def walk(self, tokens) -> list[tuple[int, ...]]:
        self.clock += 1
        hit = []
        for p in self.prefixes(tokens):
            if p not in self.cached:
                break
            hit.append(p)
            self.access[p] = self.clock
        return hit

    def match(self, tokens) -> tuple[list[int], tuple[int, ...]]:
        hit = self.walk(tokens)
        self.queries += len(tokens)
        self.hits += len(hit) * self.page_size
        self.hit_calls += bool(hit)
        self.match_calls += 1
        return [self.cached[p] for p in hit], hit[-1] if hit else ()

    def insert(self, tokens, pages) -> int:
        self.clock += 1
        present = 0
        for k, p in enumerate(self.prefixes(tokens)):
            if p in self.cached:
                present += self.page_size
            else:
                self.cached[p] = pages[k]
                self.refs[pages[k]] += 1
            self.access[p] = self.clock
        return present

    def locked(self, prefix) -> int:
        return sum(q[:len(prefix)] == prefix for q in self.locks)

    def evictable_leaves(self) -> list[tuple[int, ...]]:
        ps = self.page_size
        inner = {p[:-ps] for p in self.cached}
        return [p for p in self.cached if p not in inner and not self.locked(p)]


def check(radix: RadixCache, pool: PagePool, model: Model) -> None:
    assert tree_contents(radix) == model.cached
    assert [pool.refcount(p) for p in range(1, pool.num_pages)] == \
        [model.refs.get(p, 0) for p in range(1, pool.num_pages)]
    pool.check_consistency()
    assert radix.cached_pages == len(model.cached)
    assert radix.evictable_pages == sum(not model.locked(p) for p in model.cached)
    s = radix.stats
    assert (s.queries, s.hits, s.match_calls, s.hit_calls) == \
        (model.queries, model.hits, model.match_calls, model.hit_calls)


def release_refs(pool: PagePool, model: Model, pages: list[int]) -> None:
    pool.decref(pages)
    for p in pages:
        model.refs[p] -= 1


def alloc_refs(pool: PagePool, radix: RadixCache, model: Model, n: int) -> list[int] | None:
    if pool.num_free < n:
        evict_checked(radix, pool, model, n - pool.num_free)
    try:
        pages = pool.alloc(n)
    except OutOfPages:
        return None
    for p in pages:
        model.refs[p] = 1
    return pages


def evict_checked(radix: RadixCache, pool: PagePool, model: Model, k: int) -> None:
    before = dict(model.cached)
    freed = radix.evict(k)
    after = tree_contents(radix)
    removed = before.keys() - after.keys()
    assert after.keys() <= before.keys()
    assert not any(model.locked(p) for p in removed)
    for p in removed:
        model.refs[before[p]] -= 1
        del model.cached[p]
    assert freed == sum(model.refs[before[p]] == 0 for p in removed)
    assert freed >= k or radix.evictable_pages == 0
    # least recently used first: nothing evicted was touched after a surviving evictable leaf
    if removed and model.evictable_leaves():
        assert max(model.access[p] for p in removed) <= min(model.access[p] for p in model.evictable_leaves())
    for p in removed:
        del model.access[p]


@pytest.mark.parametrize("page_size", [1, 2, 4])
def test_random_operations_agree_with_a_model(seed, page_size):
    rng = random.Random(seed)
    pool = PagePool(24)
    radix = RadixCache(pool, page_size)
    model = Model(page_size)
    requests = []  # (tokens, pages, node, prefix) of requests holding pages and a lock
    handles = []  # (node, prefix) from matches, never locked by the test

    def tokens():
        return [rng.randrange(3) for _ in range(rng.randint(0, 4 * page_size + 3))]

    for _ in range(400):
        op = rng.random()
        if op < 0.2:
            t = tokens()
            m = radix.match(t)
            pages, prefix = model.match(t)
            assert (m.pages, m.num_tokens) == (pages, len(pages) * page_size)
            handles.append((m.node, prefix))
        elif op < 0.45:  # admit: hit, lock, compute the rest, publish, keep running
            t = tokens()
            m = radix.match(t)
            pages, prefix = model.match(t)
            assert m.pages == pages
            radix.lock(m.node)
            model.locks.append(prefix)
            pool.incref(m.pages)
            for p in m.pages:
                model.refs[p] += 1
            own = alloc_refs(pool, radix, model, -(-len(t) // page_size) - len(m.pages))
            if own is None:
                release_refs(pool, model, m.pages)
                radix.unlock(m.node)
                model.locks.remove(prefix)
            else:
                assert radix.insert(t, m.pages + own) == model.insert(t, m.pages + own)
                node = m.node
                if rng.random() < 0.5:  # publish the whole prompt under the request's lock
                    node = radix.lock_prefix(t)
                    walked = model.walk(t)
                    model.locks.append(walked[-1] if walked else ())
                    radix.unlock(m.node)
                    model.locks.remove(prefix)
                    prefix = model.locks[-1]
                requests.append((t, m.pages + own, node, prefix))
        elif op < 0.65 and requests:  # finish: cache again (all present), unlock, drop references
            t, pages, node, prefix = requests.pop(rng.randrange(len(requests)))
            assert radix.insert(t, pages) == model.insert(t, pages)
            radix.unlock(node)
            model.locks.remove(prefix)
            release_refs(pool, model, pages)
        elif op < 0.8:  # a request computed from scratch, cached as it leaves
            t = tokens()
            own = alloc_refs(pool, radix, model, -(-len(t) // page_size))
            if own is not None:
                assert radix.insert(t, own) == model.insert(t, own)
                release_refs(pool, model, own)
        elif op < 0.9:
            evict_checked(radix, pool, model, rng.randint(0, 6))
        elif handles:  # the test never locked these: unlocking must refuse
            node, prefix = handles.pop(rng.randrange(len(handles)))
            if not model.locked(prefix) or node.parent is None and prefix:
                with pytest.raises(ValueError):
                    radix.unlock(node)
        check(radix, pool, model)

    for t, pages, node, prefix in requests:
        radix.unlock(node)
        release_refs(pool, model, pages)
    radix.reset()
    assert radix.cached_pages == 0 and pool.num_used == 0
    pool.check_consistency()
