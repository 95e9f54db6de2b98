"""The storage tier (L3) below host memory, at the KV manager: what one engine's host memory takes
reaches a shared directory, and another engine with nothing cached finds it there, fetches it
through host memory to the device with its bytes intact (windows too), by the prefetch policy; a
record damaged on disk is counted, removed and written again."""

from __future__ import annotations

import random
import threading

import pytest

from engine.core.config import EngineConfig
from engine.core.families.cache_tier import TierContext, prefix_keys
from engine.core.kv import prefetch
from engine.core.tiers.file import FileTier

from test_hierarchy import TieredHarness, make, run_to_completion


def engine(directory, windowed: bool, rng: random.Random, policy: str = "wait_complete", threshold: int = 8,
           tier_wrapper=None):
    """A KV manager with host memory and a file tier in ``directory`` (a separate engine each call)."""
    m, kv, host = make(4, windowed, "write_through")
    config = EngineConfig(model="-", enable_hierarchical_cache=True, hicache_storage_backend="file",
                          hicache_storage_dir=str(directory))
    files = FileTier(TierContext(None, None, config, host.ctx.layout))
    m.lower.attach_storage(tier_wrapper(files) if tier_wrapper else files, policy, threshold)
    return m, TieredHarness(m, kv, rng), files


def run(m, harness, prompt, **kwargs):
    """run_to_completion, then wait for what it handed the storage tier's writer to land."""
    out = run_to_completion(m, harness, prompt, **kwargs)
    assert m.lower.flush_storage(5)
    return out


def every_page_back(m) -> None:
    """Every page and record is accounted for, and all go back when the prefix cache is emptied."""
    m.check_consistency()
    m.reset_prefix_cache()
    m.check_consistency()
    assert m.stats().num_used == 0 and not m.lower.tier.keys()


@pytest.mark.parametrize("windowed", [False, True])
def test_a_second_engine_fetches_what_the_first_stored(tmp_path, seed, windowed):
    rng = random.Random(seed)
    first, h1, _ = engine(tmp_path, windowed, rng)
    prompt = [rng.randrange(1000) for _ in range(rng.randint(5, 8) * 4 + rng.randrange(4))]
    run(first, h1, prompt, outputs=rng.randint(0, 5))
    assert first.lower.stats.storage_written > 0
    second, h2, _ = engine(tmp_path, windowed, rng)
    follow = prompt + [rng.randrange(1000) for _ in range(3)]
    second.prefetch(follow[:-1])
    hit, _ = run(second, h2, follow)  # reads every hit token back from the fetched pages
    assert hit == len(prompt) // 4 * 4 and second.lower.stats.storage_hit_tokens == hit
    every_page_back(second)


def test_a_short_storage_hit_is_not_fetched_and_a_corrupted_record_ends_it(tmp_path, seed):
    rng = random.Random(seed)
    first, h1, files = engine(tmp_path, False, rng)
    prompt = [rng.randrange(1000) for _ in range(40)]
    run(first, h1, prompt + [1])
    short, hs, _ = engine(tmp_path, False, rng, threshold=44)
    assert run(short, hs, prompt + [2])[0] == 0  # 40 tokens stored, 44 wanted
    key = prefix_keys(prompt, 4, first.lower.model_key)[6]
    path = files._path(key)
    raw = bytearray(path.read_bytes())
    raw[-1 - rng.randrange(16)] ^= 0x55
    path.write_bytes(bytes(raw))
    second, h2, _ = engine(tmp_path, False, rng)
    assert run(second, h2, prompt + [3])[0] == 24
    assert second.lower.stats.checksum_failures == 1
    second.check_consistency()


@pytest.mark.parametrize("kind", ["page", "window"])
def test_a_bad_stored_record_is_counted_and_removed_and_a_good_one_takes_its_place(tmp_path, seed, kind):
    """A stored page (or, for a model with windows, a window record) damaged on disk: the engine
    reading it counts it, the file tier removes it, and the engine that computes those tokens again
    writes a good record there, which a third engine hits."""
    rng = random.Random(seed)
    windowed = kind == "window"
    first, h1, files = engine(tmp_path, windowed, rng)
    prompt = [rng.randrange(1000) for _ in range(40)]
    run(first, h1, prompt + [1])
    page_keys = prefix_keys(prompt, 4, first.lower.model_key)
    path = rng.choice(sorted(tmp_path.rglob("*-w*.kv"))) if windowed else files._path(page_keys[6])
    raw = bytearray(path.read_bytes())
    raw[-1 - rng.randrange(16)] ^= 0x55
    path.write_bytes(bytes(raw))
    second, h2, _ = engine(tmp_path, windowed, rng)
    assert run(second, h2, prompt + [3])[0] < 40
    assert second.lower.stats.checksum_failures == 1
    second.check_consistency()
    third, h3, _ = engine(tmp_path, windowed, rng)
    assert run(third, h3, prompt + [4])[0] == 40 and third.lower.stats.checksum_failures == 0


class Slow:
    """A tier whose reads wait until released: what a prefetch has read by admission is up to the policy."""

    def __init__(self, tier):
        self.tier, self.go = tier, threading.Event()

    def __getattr__(self, name):
        return getattr(self.tier, name)

    def get(self, keys):
        self.go.wait(10)
        return self.tier.get(keys)


@pytest.mark.parametrize("policy", ["best_effort", "timeout", "wait_complete"])
def test_the_prefetch_policy_decides_how_long_admission_waits(tmp_path, seed, policy, monkeypatch):
    rng = random.Random(seed)
    monkeypatch.setattr(prefetch, "TIMEOUT_BASE", 0.05)
    monkeypatch.setattr(prefetch, "TIMEOUT_PER_KI_TOKEN", 0.0)
    first, h1, _ = engine(tmp_path, False, rng)
    prompt = [rng.randrange(1000) for _ in range(40)]
    run(first, h1, prompt + [1])
    slow = []
    second, h2, _ = engine(tmp_path, False, rng, policy, tier_wrapper=lambda t: slow.append(Slow(t)) or slow[0])
    second.prefetch(prompt)
    if policy == "wait_complete":
        threading.Timer(0.2, slow[0].go.set).start()
    hit = run(second, h2, prompt + [2])[0]
    slow[0].go.set()
    assert hit == (40 if policy == "wait_complete" else 0)
    second.check_consistency()


def test_records_evicted_while_a_prefetch_reads_them_end_the_hit_without_a_failure(tmp_path, seed):
    """Another engine's size bound deletes the tail of a prefix between this engine's lookup and its
    reads: the hit is the records read before it, nothing counted as failed or damaged."""
    rng = random.Random(seed)
    first, h1, files = engine(tmp_path, False, rng)
    prompt = [rng.randrange(1000) for _ in range(40)]
    run(first, h1, prompt + [1])
    slow = []
    second, h2, _ = engine(tmp_path, False, rng, tier_wrapper=lambda t: slow.append(Slow(t)) or slow[0])
    second.prefetch(prompt)  # finds all 10 records, then waits to read them
    cut = rng.randrange(2, 10)
    for key in prefix_keys(prompt, 4, first.lower.model_key)[cut:]:
        files._path(key).unlink()
    slow[0].go.set()
    assert run(second, h2, prompt + [2])[0] == cut * 4
    s = second.lower.stats
    assert s.checksum_failures == s.storage_read_failures == 0 and slow[0].tier.read_failures == 0
    second.check_consistency()


class Counted(Slow):
    """A slow tier whose reads are counted: what the prefetch asked of the tier, call by call."""

    def __init__(self, tier):
        super().__init__(tier)
        self.gets = []

    def get(self, keys):
        self.gets.append(list(keys))
        return super().get(keys)


@pytest.mark.parametrize("damage", [None, "missing", "corrupt"])
def test_a_long_hit_is_read_in_one_call_and_a_bad_record_in_it_ends_the_hit_there(tmp_path, seed, damage):
    """A hit of many pages costs the tier one read of all of them (not one a few pages); a record
    gone or damaged in the middle of that read ends the hit exactly before it (counted where it
    is damaged; a gone one is no failure), nothing read after it is kept, and every page goes back."""
    rng = random.Random(seed)
    first, h1, files = engine(tmp_path, False, rng)
    pages = rng.randint(12, 20)
    prompt = [rng.randrange(1000) for _ in range(pages * 4)]
    run(first, h1, prompt + [1])
    keys = prefix_keys(prompt, 4, first.lower.model_key)
    counted = []
    second, h2, _ = engine(tmp_path, False, rng, tier_wrapper=lambda t: counted.append(Counted(t)) or counted[0])
    second.prefetch(prompt)  # finds every page, then waits to read them
    cut = rng.randrange(3, pages - 1) if damage else pages
    if damage == "missing":
        files._path(keys[cut]).unlink()
    elif damage == "corrupt":
        raw = bytearray(files._path(keys[cut]).read_bytes())
        raw[-1 - rng.randrange(16)] ^= 1 << rng.randrange(8)
        files._path(keys[cut]).write_bytes(bytes(raw))
    counted[0].go.set()
    hit, _ = run(second, h2, prompt + [2])
    assert counted[0].gets[0] == keys  # one read of them all
    assert hit == cut * 4 and second.lower.stats.storage_hit_tokens == hit
    assert second.lower.stats.checksum_failures == (damage == "corrupt") and counted[0].tier.read_failures == 0
    every_page_back(second)


def test_a_hit_longer_than_one_read_holds_is_read_in_runs_of_that_bound(tmp_path, seed, monkeypatch):
    rng = random.Random(seed)
    first, h1, files = engine(tmp_path, False, rng)
    prompt = [rng.randrange(1000) for _ in range(40)]
    run(first, h1, prompt + [1])
    per_read = rng.randint(2, 4)
    record = files.ctx.layout.record_bytes("page")
    monkeypatch.setattr(prefetch, "READ_BATCH_BYTES", per_read * record + rng.randrange(record))
    counted = []
    second, h2, _ = engine(tmp_path, False, rng, tier_wrapper=lambda t: counted.append(Counted(t)) or counted[0])
    counted[0].go.set()
    assert run(second, h2, prompt + [2])[0] == 40
    keys = prefix_keys(prompt, 4, first.lower.model_key)
    assert counted[0].gets == [keys[i:i + per_read] for i in range(0, 10, per_read)]
    second.check_consistency()
