"""The hierarchical cache at the KV manager: pages leaving the device go to the host tier by the
write policy, a match past the device loads them back into fresh pages with their bytes intact
(windows too), a corrupted record is a shorter hit, and every page and record stays accounted for.

The KV is a real KVCache (float64) whose slots hold token ids (+1; 0 is an empty slot), so what a load
brings back is checked against what was written, byte for byte, through the host tier's arenas.
"""

from __future__ import annotations

import hashlib
import random

import pytest
import torch

from engine.core.config import EngineConfig
from engine.core.families.cache_tier import TierContext
from engine.core.kv.hierarchy import SELECTIVE_HITS
from engine.core.kv.tier_layout import host_capacity, tier_layout
from engine.core.kv.host_copy import HostCopy
from engine.core.kv.manager import KVManager
from engine.core.kv.radix import Tier
from engine.core.kv.storage import KVCache
from engine.core.tiers.host import HostTier
from engine.server import wire
from engine.server.metrics import ServerMetrics

from test_manager import NUM_PAGES, SPECS, Harness, cached_prefixes, new_seq

WINDOW, PLAIN = 0, 1  # SPECS: a windowed layer and a plain one


def make(page_size: int, windowed: bool, policy: str = "write_through", layout: str = "layer_first",
         ratio: float = 2.0, reach: int = 5, num_window: int = 14,
         window_ratio: float | None = None, rows: FakeRows | None = None) -> tuple[KVManager, KVCache, HostTier]:
    specs = SPECS if windowed else SPECS[1:]
    kv = KVCache(specs, NUM_PAGES, page_size, torch.float64, "cpu", num_window if windowed else 0)
    m = KVManager(NUM_PAGES, page_size, True, kv, num_window if windowed else 0, reach if windowed else 0)
    lay = tier_layout(kv, "test-model", rows)
    config = EngineConfig(model="-", hicache_mem_layout=layout, enable_hierarchical_cache=True)
    capacity = host_capacity(kv, lay, ratio)
    if window_ratio is not None and windowed:
        capacity["window"] = host_capacity(kv, lay, window_ratio)["window"]
    tier = HostTier(TierContext(None, None, config, lay, capacity, kv.device))
    m.attach_lower(tier, policy, lay.model, kv, rows)
    return m, kv, tier


class FakeRows:
    """A proposer's rows of pages (page_rows.py): each page's a digest of the tokens up to its end,
    kept where ``keep`` computed or ``restore`` gave them, let go by ``clear``."""

    identity, record_bytes = "fake-drafter", 16

    def __init__(self, page_size: int) -> None:
        self.ps, self.kept = page_size, {}

    def of(self, tokens: list[int], page: int) -> torch.Tensor:
        digest = hashlib.blake2b(repr(tokens[:(page + 1) * self.ps]).encode(), digest_size=self.record_bytes)
        return torch.frombuffer(bytearray(digest.digest()), dtype=torch.uint8)

    def keep(self, tokens: list[int]) -> None:
        for i in range(len(tokens) // self.ps):
            self.kept[tuple(tokens[:(i + 1) * self.ps])] = self.of(tokens, i)

    def clear(self) -> None:
        self.kept.clear()

    def _run(self, tokens: list[int], first: int, count: int) -> list[torch.Tensor]:
        out = []
        for i in range(first, min(first + count, len(tokens) // self.ps)):
            if (rows := self.kept.get(tuple(tokens[:(i + 1) * self.ps]))) is None:
                break
            out.append(rows)
        return out

    def held(self, tokens: list[int], num_pages: int) -> int:
        return len(self._run(tokens, 0, num_pages))

    def records(self, tokens: list[int], first: int, count: int) -> torch.Tensor | None:
        rows = self._run(tokens, first, count)
        return torch.stack(rows) if rows else None

    def restore(self, tokens: list[int], first: int, records: list[torch.Tensor]) -> None:
        for i, rows in enumerate(records, first):
            self.kept[tuple(tokens[:(i + 1) * self.ps])] = rows.clone()


class KVSlots:
    """The harness's fake KV store read from a real KVCache: page -> token per slot."""

    def __init__(self, kv: KVCache, layer: int) -> None:
        self.kv, self.layer = kv, layer

    def get(self, page: int, default=None):
        return [int(v) - 1 if v else None for v in self.kv.layer(self.layer).k[page, :, 0, 0].tolist()]

    __getitem__ = get


class TieredHarness(Harness):
    """Harness (test_manager.py) over a real KVCache: every token written lands in its page's slot
    (and its window page's, where it has one), so pages loaded back from the host tier are read."""

    def __init__(self, m: KVManager, kv: KVCache, rng: random.Random) -> None:
        super().__init__(m, rng)
        self.kv = kv
        self.plain = len(kv.specs) - 1
        self.slots = KVSlots(kv, self.plain)
        self.stems = [[rng.randrange(50) for _ in range(rng.randint(2, 4) * self.ps)] for _ in range(4)]
        self.ended: list[list[int]] = []  # tokens of sequences that left, cached

    def prompt(self):
        """Now and then a sequence that left comes back with more tokens (a conversation's next turn)."""
        short = [t for t in self.ended if len(t) <= 6 * self.ps]  # (longer ones would grow without end)
        if short and self.rng.random() < 0.3:
            return self.rng.choice(short) + [self.rng.randrange(50) for _ in range(self.rng.randint(1, 5))]
        return super().prompt()

    def drop(self, live, cache):
        if cache:
            self.ended.append(live.seq.tokens[:self.committed(live.seq)])
        super().drop(live, cache)

    def write(self, pages, lo, tokens):
        for pos in range(lo, lo + len(tokens)):
            page = pages[pos // self.ps]
            assert self.m.pool.refcount(page) == 1, f"a write into shared page {page}"
            self.kv.layer(self.plain).k[page, pos % self.ps, 0, 0] = tokens[pos - lo] + 1
            if self.m.window is not None and self.m.window.has(page):
                self.kv.layer(WINDOW).k[self.m.window.page_of(page), pos % self.ps, 0, 0] = tokens[pos - lo] + 1

    def apply_copies(self):
        copies = self.m.take_page_copies()
        if copies:
            src, dst = zip(*copies)
            self.kv.copy_pages(list(src), list(dst))

    def known_prefixes(self):
        """Device prefixes and those only the host tier holds (page None)."""
        out = dict(cached_prefixes(self.m))
        for node in self.m.radix.lower_nodes():
            key = tuple(self.m.radix.prefix(node))
            for i in range(len(node.key) // self.ps):
                out.setdefault(key[:len(key) - len(node.key) + (i + 1) * self.ps], None)
        return out

    def check(self):
        super().check()
        if self.m.window is None:
            return
        for live in self.live.values():  # what the next step reads of the windows holds the right tokens
            seq, n = live.seq, self.committed(live.seq)
            pages = self.m.pages(seq)
            for pos in range(max(0, n - self.m.window_reach), n):
                w = self.m.window.page_of(pages[pos // self.ps])
                assert w and self.kv.layer(WINDOW).k[w, pos % self.ps, 0, 0] == seq.tokens[pos] + 1, \
                    f"sequence {seq.seq_id} reads a wrong window at {pos}"


def rows_metrics(m: KVManager) -> dict[str, float]:
    """The rows records' counters as /metrics shows them, the stats sent from the engine process."""
    sent = wire.encoder.encode(wire.Outputs([], wire.Stats(hicache=m.hicache_stats())))
    text = ServerMetrics("m", m.page_size, NUM_PAGES).render(wire.from_engine_decoder.decode(sent).stats, 0)
    lines = [line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("engine:hicache_rows_")]
    return {name.split("_")[2]: float(value) for name, value in lines}


def run_to_completion(m: KVManager, harness: TieredHarness, tokens: list[int], outputs: int = 0):
    """Admit ``tokens`` as a prompt, compute it and ``outputs`` tokens, cache it all; the hit it had."""
    harness.ids += 1
    seq = new_seq(harness.ids, tokens)
    hit = m.match_prefix(seq, tokens[:-1])
    assert harness.read(m.pages(seq), hit) == tokens[:hit]
    assert m.allocate(seq, len(tokens) - hit)
    harness.write(m.pages(seq), hit, tokens[hit:])
    m.commit(seq, len(tokens))
    for _ in range(outputs):
        seq.output_token_ids.append(harness.rng.randrange(1000, 10**9))
        assert m.allocate(seq, 1)
        harness.write(m.pages(seq), seq.num_tokens - 1, seq.tokens[-1:])
        m.commit(seq, seq.num_tokens)
    harness.check()
    m.free(seq)
    return hit, seq


@pytest.mark.parametrize("windowed", [False, True])
@pytest.mark.parametrize("policy", ["write_through", "write_back"])
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_a_prefix_evicted_from_the_device_is_loaded_back_from_host(seed, windowed, policy, layout):
    rng = random.Random(seed)
    ps = 4
    m, kv, tier = make(ps, windowed, policy, layout)
    h = TieredHarness(m, kv, rng)
    prompt = [rng.randrange(1000) for _ in range(rng.randint(5, 8) * ps + rng.randrange(ps))]
    run_to_completion(m, h, prompt, outputs=rng.randint(0, 6))
    written = m.lower.stats.written_pages
    assert (written > 0) == (policy == "write_through")
    m.evict(NUM_PAGES)
    assert m.stats().num_cached == 0 and m.stats().num_used == 0
    assert m.lower.stats.written_pages >= len(prompt) // ps
    m.check_consistency()
    follow = prompt + [rng.randrange(1000) for _ in range(rng.randint(1, 9))]
    hit, _ = run_to_completion(m, h, follow)  # reads every hit token back from the loaded pages
    assert hit == len(prompt) // ps * ps
    assert m.lower.stats.hit_tokens == hit and m.lower.stats.checksum_failures == 0
    assert rows_metrics(m) == {}  # no proposer, no rows counters
    m.check_consistency()
    m.reset_prefix_cache()
    m.check_consistency()
    assert m.stats().num_used == 0 and m.stats().num_window_used == 0 and not tier.keys()


@pytest.mark.parametrize("windowed", [False, True])
def test_a_corrupted_host_record_is_a_shorter_hit_and_is_counted(seed, windowed):
    rng = random.Random(seed)
    ps = 4
    m, kv, tier = make(ps, windowed, "write_back")
    h = TieredHarness(m, kv, rng)
    stem = [rng.randrange(1000) for _ in range(4 * ps)]
    longer = stem + [rng.randrange(1000) for _ in range(4 * ps)]
    run_to_completion(m, h, stem + [7])
    run_to_completion(m, h, longer + [7])  # two nodes: the stem's and the rest
    m.evict(NUM_PAGES)
    rest = next(n for n in m.radix.lower_nodes() if n.parent.parent is not None)
    assert tuple(m.radix.prefix(rest)) == tuple(longer)
    tier.corrupt(rest.lower[rng.randrange(len(rest.lower))], rng.randrange(8))
    hit, _ = run_to_completion(m, h, longer + [7, 8])
    assert hit == len(stem) and m.lower.stats.checksum_failures == 1
    m.check_consistency()
    hit, _ = run_to_completion(m, h, longer + [7, 9])  # computed again, cached again
    assert hit == len(longer)


def test_write_through_selective_writes_a_node_once_matched_often(seed):
    rng = random.Random(seed)
    m, kv, tier = make(4, False, "write_through_selective")
    h = TieredHarness(m, kv, rng)
    prompt = [rng.randrange(1000) for _ in range(12)]
    run_to_completion(m, h, prompt + [1])
    for i in range(SELECTIVE_HITS):
        assert m.lower.stats.written_pages == 0
        run_to_completion(m, h, prompt + [2 + i, 3])
    assert m.lower.stats.written_pages == 3
    m.evict(NUM_PAGES)
    assert run_to_completion(m, h, prompt + [9, 9])[0] == 12  # the node matched often came back
    m.check_consistency()


@pytest.mark.parametrize("policy", ["write_back", "write_through_selective"])
def test_rows_let_go_before_their_pages_are_written_are_written_with_them(seed, policy):
    """A proposer's rows of a prompt's pages, let go while the pages are on the device and not yet
    written (write-back writes them at eviction, selective write-through at the second match), are
    given back from the copy the tree's node took of them on a device hit (cut with the node where a
    shorter prompt cuts it), go down with the pages, and come back intact from host memory; a match
    whose rows are nowhere is counted a miss."""
    rng = random.Random(seed)
    ps = 4
    rows = FakeRows(ps)
    m, kv, tier = make(ps, False, policy, rows=rows)
    h = TieredHarness(m, kv, rng)
    stem, tail, other = ([rng.randrange(1000) for _ in range(2 * ps)] for _ in range(3))

    def given_back(prefix: list[int]) -> bool:
        pages = range(len(prefix) // ps)
        return [rows.kept.get(tuple(prefix[:(i + 1) * ps]), torch.empty(0)).tolist() for i in pages] == \
            [rows.of(prefix, i).tolist() for i in pages]

    rows.keep(stem + tail)  # computed with the prompt
    run_to_completion(m, h, stem + tail + [1])
    run_to_completion(m, h, other + [1])  # its rows never computed
    for i in range(SELECTIVE_HITS):
        rows.clear()  # the proposer lets them go (the second time all but the first page's: one given back)
        rows.keep(stem[:ps * i])
        run_to_completion(m, h, stem + [2 + i] * ps + [1])
        assert given_back(stem)
    run_to_completion(m, h, other + [2])
    assert rows_metrics(m) == {"written": m.lower.stats.written_rows, "read": 3, "missed": 2}
    m.evict(NUM_PAGES)
    assert m.lower.stats.written_rows == (4 if policy == "write_back" else 2)
    for prefix in [stem] + ([stem + tail] if policy == "write_back" else []):
        rows.clear()
        assert run_to_completion(m, h, prefix + [3, 3])[0] == len(prefix)
        assert given_back(prefix)
    assert rows_metrics(m)["read"] == (9 if policy == "write_back" else 5)
    m.check_consistency()
    m.reset_prefix_cache()
    assert not tier.keys()


def test_a_full_host_tier_lets_go_of_the_least_recently_used(seed):
    """Room for one prompt's pages: writing the second lets the first go; the first is then a miss."""
    rng = random.Random(seed)
    m, kv, tier = make(4, False, "write_back", ratio=8 / (NUM_PAGES - 1))
    h = TieredHarness(m, kv, rng)
    first, second = ([rng.randrange(1000) for _ in range(32)] for _ in range(2))
    run_to_completion(m, h, first + [1])
    m.evict(NUM_PAGES)
    run_to_completion(m, h, second + [1])
    m.evict(NUM_PAGES)
    m.check_consistency()
    assert tier.free("page") == 0 and len(tier.keys()) == 8
    assert run_to_completion(m, h, first + [2])[0] == 0
    m.evict(NUM_PAGES)
    assert run_to_completion(m, h, first + [3])[0] == 32
    m.check_consistency()


@pytest.mark.parametrize("page_size,windowed,policy", [
    (1, False, "write_through"), (4, False, "write_back"), (2, True, "write_through"), (4, True, "write_back"),
    (4, True, "write_through_selective")])
@pytest.mark.parametrize("copies", ["landed", "held"])
def test_random_operations_with_a_small_host_tier_keep_every_page_and_record_accounted_for(
        seed, page_size, windowed, policy, copies, monkeypatch):
    """``held``: every copy from the device stays on its way (as a GPU's behind a long step) until a
    read needs it, while its pages are freed and reused: the tree and the tier still agree."""
    if copies == "held":
        monkeypatch.setattr(HostCopy, "ready", lambda self: False)
    rng = random.Random(seed)
    m, kv, tier = make(page_size, windowed, policy, rng.choice(["layer_first", "page_first"]), ratio=1.0,
                       window_ratio=4.0)  # room for the windows of the pages' ends
    h = TieredHarness(m, kv, rng)
    h.run(["add"] * 3 + ["step"] * 6 + ["rollback", "finish", "preempt", "fork", "export", "evict", "flush"], 300)
    for live in list(h.live.values()):
        h.drop(live, cache=True)
    back = h.ended[-1]  # the last sequence to leave comes back once all of it is off the device; it hits
    # at least as far as on the device (further where the windows of an end are back from host memory)
    on_device = m.radix.match(back, record=False).num_tokens
    m.evict(NUM_PAGES)
    hit = run_to_completion(m, h, back + [rng.randrange(50)])[0]
    if policy != "write_through_selective":
        assert hit >= on_device and m.lower.stats.hit_tokens >= hit
    if not windowed and policy != "write_through_selective":
        assert hit == len(back) // page_size * page_size
    m.reset_prefix_cache()
    h.check()
    s = m.stats()
    assert s.num_used == 0 and s.num_window_used == 0 and not tier.keys()
    assert all(Tier.HOST not in n.tiers for n in m.radix.nodes())
