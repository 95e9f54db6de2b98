"""KVManager: the one owner of KV state, under random operation sequences against a simple model.

The model is a fake KV store: what token each slot of each page holds. Every step writes its
sequence's tokens into the pages the manager gave it, page copies are applied as the runner
would, and after every operation each live sequence must read its own committed tokens back from
its page table, every cached prefix from its pages, no rolled-back token may be cached, no locked
prefix evicted, and every reference, lock and window hold accounted for (check_consistency).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from engine.core.kv.manager import KVManager
from engine.core.kv.storage import KVCache, KVLayerSpec
from engine.core.sampling_params import SamplingParams
from engine.core.sequence import Sequence

SPECS = [KVLayerSpec(1, 8, 0, windowed=True), KVLayerSpec(1, 4, 0)]
NUM_PAGES = 40


def make(page_size: int, windowed: bool, caching: bool = True, num_window: int = 14, reach: int = 5,
         max_rollback: int = 0) -> KVManager:
    if not windowed:
        return KVManager(NUM_PAGES, page_size, caching, max_rollback=max_rollback)
    kv = KVCache(SPECS, NUM_PAGES, page_size, torch.float32, "cpu", num_window)
    return KVManager(NUM_PAGES, page_size, caching, kv, num_window, reach, max_rollback)


def new_seq(seq_id: int, prompt: list[int], outputs: list[int] = ()) -> Sequence:
    seq = Sequence(seq_id, f"r{seq_id}", 0, list(prompt), SamplingParams())
    seq.output_token_ids = list(outputs)
    return seq


def cached_prefixes(m: KVManager) -> dict[tuple[int, ...], int]:
    """Every cached whole-page prefix -> the page holding its last page of tokens."""
    out, ps = {}, m.page_size
    for node in m.radix.nodes():
        if node.parent is None:
            continue
        path, n = [], node
        while n.parent is not None:
            path.append(n)
            n = n.parent
        key: tuple[int, ...] = ()
        for n in reversed(path):
            key += n.key
        for i in range(len(node.pages)):
            out[key[:len(key) - len(node.key) + (i + 1) * ps]] = node.pages[i]
    return out


@dataclass
class Live:
    seq: Sequence
    floor: int = 0  # the shortest end a rollback may return to (its start, a fork, the last step, max_rollback)
    locked: tuple[int, ...] = ()  # the prefix whose radix node it keeps locked
    published: bool = False  # its prompt went to the prefix cache (and its lock with it)


class Harness:
    def __init__(self, m: KVManager, rng: random.Random) -> None:
        self.m, self.rng, self.ps = m, rng, m.page_size
        self.slots: dict[int, list[int | None]] = {}  # the fake KV store: page -> token per slot
        self.live: dict[int, Live] = {}
        self.ids = 0
        self.rejected: set[tuple[int, ...]] = set()  # rolled-back whole-page prefixes never confirmed since
        self.lookups = [0, 0]
        self.stems = [[rng.randrange(50) for _ in range(rng.randint(1, 12))] for _ in range(4)]

    # -- the fake device ----------------------------------------------------------------------

    def write(self, pages: list[int], lo: int, tokens: list[int]) -> None:
        for pos in range(lo, lo + len(tokens)):
            page = pages[pos // self.ps]
            assert self.m.pool.refcount(page) == 1, f"a write into shared page {page}"
            self.slots.setdefault(page, [None] * self.ps)[pos % self.ps] = tokens[pos - lo]

    def apply_copies(self) -> None:
        for src, dst in self.m.take_page_copies():
            self.slots[dst] = list(self.slots.get(src, [None] * self.ps))

    def read(self, pages: list[int], n: int) -> list[int | None]:
        return [self.slots.get(pages[i // self.ps], [None] * self.ps)[i % self.ps] for i in range(n)]

    def known_prefixes(self) -> dict[tuple[int, ...], int]:
        """The whole-page prefixes a match may find."""
        return cached_prefixes(self.m)

    # -- operations ---------------------------------------------------------------------------

    def prompt(self) -> list[int]:
        stem = self.rng.choice(self.stems) if self.rng.random() < 0.8 else []
        return stem + [self.rng.randrange(50) for _ in range(self.rng.randint(1, 10))]

    def add(self) -> None:
        self.ids += 1
        seq = new_seq(self.ids, self.prompt())
        before = self.known_prefixes()
        query = seq.tokens[:-1]
        hit = self.m.match_prefix(seq, query)
        longest = max([len(k) for k in before if tuple(query[:len(k)]) == k] + [0])
        assert hit % self.ps == 0 and hit <= longest
        if self.m.window is None and self.m.lower is None:
            assert hit == longest
        live = Live(seq, hit, tuple(query[:hit]))
        self.live[seq.seq_id] = live
        assert self.read(self.m.pages(seq), hit) == seq.tokens[:hit]
        self.m.record_lookup(len(query), hit)
        self.lookups[0] += len(query)
        self.lookups[1] += hit
        if not self.step(live):
            self.drop(live, cache=False)

    def step(self, live: Live) -> bool:
        """One step of a prefill chunk or a decode; False where the pages ran short."""
        seq, m = live.seq, self.m
        done = self.committed(seq)
        if done == seq.num_tokens:  # outputs are drawn from a wide range: no two sequences share them
            seq.output_token_ids.append(self.rng.randrange(1000, 10**9))
        num_new = self.rng.randint(1, seq.num_tokens - done)
        if not m.allocate(seq, num_new):
            return False
        self.write(m.pages(seq), done, seq.tokens[done:done + num_new])
        m.commit(seq, done + num_new)
        live.floor = max(live.floor, min(done, done + num_new - m.max_rollback))
        for k in range(1, (done + num_new) // self.ps + 1):
            self.rejected.discard(tuple(seq.tokens[:k * self.ps]))
        if done + num_new >= len(seq.prompt_token_ids) and m.radix.enabled and not live.published:
            live.locked = tuple(seq.prompt_token_ids[:len(seq.prompt_token_ids) // self.ps * self.ps])
            live.published = True
        return True

    def committed(self, seq: Sequence) -> int:
        st = self.m.state(seq)
        return st.num_tokens if st is not None else 0

    def drop(self, live: Live, cache: bool) -> None:
        seq = live.seq
        n = self.committed(seq)
        self.m.free(seq, cache=cache)
        del self.live[seq.seq_id]
        if cache and self.m.radix.enabled:
            cached = cached_prefixes(self.m)
            assert all(tuple(seq.tokens[:k * self.ps]) in cached for k in range(1, n // self.ps + 1))

    def rollback(self, live: Live) -> None:
        """Reject some output tokens of the last step, or of the last ``max_rollback``, as speculative
        decoding does."""
        seq, n = live.seq, self.committed(live.seq)
        lo = max(live.floor, len(seq.prompt_token_ids))
        if n < lo:
            return
        to = self.rng.randint(lo, n)
        cached = cached_prefixes(self.m)
        others = [o.seq for o in self.live.values() if o is not live]
        for k in range(to // self.ps + 1, n // self.ps + 1):
            key = tuple(seq.tokens[:k * self.ps])
            if key not in cached and not any(self.committed(o) >= len(key) and tuple(o.tokens[:len(key)]) == key
                                             for o in others):
                self.rejected.add(key)
        self.m.rollback(seq, to)
        del seq.output_token_ids[to - len(seq.prompt_token_ids):]  # the rejected tokens
        assert len(self.m.pages(seq)) == -(-to // self.ps)
        live.floor = max(live.floor, to - self.m.max_rollback)

    def fork(self, parent: Live) -> None:
        n = self.committed(parent.seq)
        if n == 0:
            return
        self.ids += 1
        p = parent.seq
        child = new_seq(self.ids, p.prompt_token_ids[:n], p.output_token_ids[:max(0, n - len(p.prompt_token_ids))])
        if not self.m.fork(p, child, n):
            assert self.m.state(child) is None
            return
        self.apply_copies()
        parent.floor = max(parent.floor, n)  # what both share is confirmed
        self.live[child.seq_id] = Live(child, n, parent.locked, parent.published)
        shared = n // self.ps
        assert self.m.pages(child)[:shared] == self.m.pages(p)[:shared]

    def export_import(self, live: Live) -> None:
        seq, n = live.seq, self.committed(live.seq)
        if n == 0:
            return
        exported = self.m.export_pages(seq)
        assert len(exported) == -(-n // self.ps)
        self.ids += 1
        tokens = seq.tokens[:n]
        twin = new_seq(self.ids, tokens)
        longest = max([len(k) for k in self.known_prefixes() if tuple(tokens[:len(k)]) == k] + [0])
        hit = self.m.import_pages(twin, tokens)
        if hit is None:
            assert self.m.state(twin) is None
            return
        pages = self.m.pages(twin)
        assert hit % self.ps == 0 and hit <= longest and len(pages) == len(exported)
        if self.m.window is None and self.m.lower is None:
            assert hit == longest
        assert self.read(pages, hit) == tokens[:hit]  # the cache's pages, shared
        assert not set(pages[hit // self.ps:]) & set(exported)
        self.write(pages, hit, self.read(exported, n)[hit:])
        self.live[twin.seq_id] = Live(twin, n, tuple(tokens[:hit]))

    def evict(self) -> None:
        before = cached_prefixes(self.m)
        self.m.evict(self.rng.randint(1, 6))
        after = cached_prefixes(self.m)
        assert after.keys() <= before.keys()
        for live in self.live.values():
            locked = live.locked
            assert all(locked[:k * self.ps] in after for k in range(1, len(locked) // self.ps + 1)), \
                "a locked prefix was evicted"

    def run(self, ops: list[str], steps: int) -> None:
        """``steps`` operations drawn from ``ops``, each followed by the checks."""
        for _ in range(steps):
            op = self.rng.choice(ops) if self.live else "add"
            live = self.rng.choice(list(self.live.values())) if self.live else None
            if op == "add" and len(self.live) < 8:
                self.add()
            elif op == "step" and live is not None and not self.step(live):
                self.drop(live, cache=True)  # preempted: recomputed later, its computed pages cached
            elif op == "rollback" and live is not None:
                self.rollback(live)
            elif op in ("finish", "preempt") and live is not None:
                self.drop(live, cache=self.rng.random() < 0.7)
            elif op == "fork" and live is not None:
                self.fork(live)
            elif op == "export" and live is not None:
                self.export_import(live)
            elif op == "evict":
                self.evict()
            elif op == "flush":  # every unlocked prefix off the device
                self.m.evict(self.m.num_pages)
            self.check()

    # -- what must hold -----------------------------------------------------------------------

    def check(self) -> None:
        m = self.m
        m.check_consistency()
        for live in self.live.values():
            seq, n = live.seq, self.committed(live.seq)
            assert self.read(m.pages(seq), n) == seq.tokens[:n], f"sequence {seq.seq_id} reads wrong KV"
            if m.window is not None:
                a, b = m.window.span(n, n, self.ps)
                assert all(m.window.has(p) for p in m.pages(seq)[a:b])
        cached = cached_prefixes(m)
        for key, page in cached.items():
            assert self.slots[page] == list(key[-self.ps:]), f"cached prefix {key} on page {page} reads other KV"
        assert not self.rejected & cached.keys(), "rolled-back tokens reached the prefix cache"
        s = m.stats()
        assert (s.prefix_queries, s.prefix_hits) == tuple(self.lookups)
        assert s.num_cached == len(cached)


@pytest.mark.parametrize("page_size,windowed,caching,max_rollback", [
    (1, False, True, 0), (2, False, True, 0), (4, False, True, 0), (2, True, True, 0), (4, True, True, 0),
    (4, False, False, 0), (2, True, True, 3), (4, True, True, 6)])
def test_random_operations_keep_every_page_accounted_for(seed, page_size, windowed, caching, max_rollback):
    rng = random.Random(seed)
    h = Harness(make(page_size, windowed, caching, num_window=24 if max_rollback else 14,
                     max_rollback=max_rollback), rng)
    h.run(["add"] * 3 + ["step"] * 6 + ["rollback"] * 2 + ["finish", "preempt", "fork", "export", "evict"], 400)
    for live in list(h.live.values()):
        h.drop(live, cache=True)
    h.m.reset_prefix_cache()
    h.check()
    s = h.m.stats()
    assert s.num_used == 0 and s.num_window_used == 0 and s.num_cached == 0


def test_rollback_refuses_what_it_cannot_restore():
    """A rollback may not leave a shared page partly filled (the next step would write into it),
    nor reach back past the windows still held."""
    m = make(4, windowed=True, reach=5)
    seq = new_seq(1, list(range(12)))
    assert m.allocate(seq, 12)
    m.commit(seq, 12)  # the prompt's 3 pages go to the prefix cache
    with pytest.raises(ValueError, match="shared page"):
        m.rollback(seq, 10)
    seq.output_token_ids = list(range(12, 30))
    for end in (16, 24, 30):
        assert m.allocate(seq, end - m.state(seq).num_tokens)
        m.commit(seq, end)
    with pytest.raises(ValueError, match="no longer held"):
        m.rollback(seq, 17)  # the last step began at 24: windows from page 4 on are held
    m.rollback(seq, 25)
    assert m.state(seq).num_tokens == 25 and len(m.pages(seq)) == 7 and m.state(seq).window == (4, 7)
    m.check_consistency()
    with pytest.raises(ValueError, match="committed"):
        m.rollback(seq, 26)
    m.free(seq)
    m.reset_prefix_cache()
    assert m.stats().num_used == 0 and m.stats().num_window_used == 0


def test_rollback_over_several_steps_keeps_the_windows_it_returns_to():
    """With max_rollback, one-token steps keep the windows of the last max_rollback tokens' ends;
    after a rollback the sequence never takes up again a window it let go (its page may be reused)."""
    m = make(4, windowed=True, reach=5, max_rollback=6)
    seq = new_seq(1, list(range(12)), list(range(12, 30)))
    assert m.allocate(seq, 12)
    m.commit(seq, 12)
    for end in range(13, 31):
        assert m.allocate(seq, 1)
        m.commit(seq, end)
    assert m.state(seq).window == (4, 8)  # from (24 // 4 * 4 - 5) // 4: what a rollback to 24 reads
    with pytest.raises(ValueError, match="no longer held"):
        m.rollback(seq, 23)
    m.rollback(seq, 24)
    assert m.state(seq).window == (4, 6) and len(m.pages(seq)) == 6
    assert m.allocate(seq, 1)  # the step reads from page 4; a rollback of 6 would reach page 2, let go
    assert m.state(seq).window == (4, 7)
    m.check_consistency()
    m.free(seq)
    m.reset_prefix_cache()
    assert m.stats().num_used == 0 and m.stats().num_window_used == 0


@pytest.mark.parametrize("outputs", [0, 3, 4])
def test_a_page_aligned_prompt_sent_again_hits_all_but_its_last_page(seed, outputs):
    """A step computes at least one token, so the same tokens sent again match one page short of
    a page-aligned end: the prefix cache keeps the windows of that shorter end too (else the hit
    needs a window nobody kept and falls back to nothing). Also for a finished sequence's tokens."""
    rng = random.Random(seed)
    ps, pages = 4, rng.randint(3, 6)
    m = make(ps, windowed=True, reach=5)
    prompt = [rng.randrange(1000) for _ in range(pages * ps)]
    first = new_seq(1, prompt, [rng.randrange(1000) for _ in range(outputs)])
    assert m.allocate(first, len(prompt))
    m.commit(first, len(prompt))
    for end in range(len(prompt) + 1, len(first.tokens) + 1):
        assert m.allocate(first, 1)
        m.commit(first, end)
    m.free(first)
    m.check_consistency()
    for i, tokens in enumerate([prompt, first.tokens], start=2):
        again = new_seq(i, tokens)
        expected = (len(tokens) - 1) // ps * ps
        assert m.match_prefix(again, tokens[:-1]) == expected
        a, b = m.state(again).window
        assert b == expected // ps and all(m.window.has(p) for p in m.pages(again)[a:b])
        m.check_consistency()
        m.free(again, cache=False)
    m.reset_prefix_cache()
    assert m.stats().num_used == 0 and m.stats().num_window_used == 0


def test_a_sequence_holds_one_state_and_every_page_comes_back():
    m = make(4, windowed=False)
    a, b = new_seq(1, list(range(10))), new_seq(2, list(range(10)))
    assert m.allocate(a, 10)
    m.commit(a, 10)
    with pytest.raises(ValueError, match="already holds"):
        m.match_prefix(a, a.tokens)
    assert m.match_prefix(b, b.tokens[:-1]) == 8 and m.pages(b) == m.pages(a)[:2]
    assert m.stats().usage == 3 / (NUM_PAGES - 1)
    m.free(a, cache=False)
    m.free(b, cache=False)
    assert m.stats().usage == 0 and m.stats().num_cached == 2
    assert m.reset_prefix_cache() == 2 and m.stats().num_used == 0
