"""The file tier's size bound (--hicache-storage-max-size, core/tiers/bound.py): least recently used
records are deleted first (a hit makes a record recent), the bound holds while two processes write
one directory, and a record deleted under a reader is a miss, never an error."""

from __future__ import annotations

import multiprocessing
import os
import random
import shutil
import threading

import torch

from engine.core.config import EngineConfig
from engine.core.families.cache_tier import TierContext, TierPage, prefix_keys
from engine.core.tiers import bound
from engine.core.tiers.file import FileTier

from test_file_tier import LAYOUT, records

RECORDS = 10  # the bound, in records


def record_bytes(directory) -> int:
    """The size of one record's file (all are alike)."""
    probe = FileTier(TierContext(None, None, EngineConfig(
        model="-", enable_hierarchical_cache=True, hicache_storage_backend="file", hicache_storage_dir=str(directory)),
        LAYOUT))
    rec = records(1, 0)[0]
    probe.put([rec])
    size = probe._path(rec.key).stat().st_size
    shutil.rmtree(directory)
    return size


def bounded(directory, size: int) -> FileTier:
    config = EngineConfig(model="-", enable_hierarchical_cache=True, hicache_storage_backend="file",
                          hicache_storage_dir=str(directory), hicache_storage_max_size=RECORDS * size / 2**30)
    return FileTier(TierContext(None, None, config, LAYOUT))


def directory_bytes(directory) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*.kv"))


def test_the_least_recently_used_records_go_first(tmp_path, seed):
    size = record_bytes(tmp_path / "probe")
    rng = random.Random(seed)
    t, recs = bounded(tmp_path, size), records(RECORDS + 3, seed)
    for i, r in enumerate(recs[:RECORDS]):  # written in order, each a second after the one before
        assert t.put([r]) == [True]
        os.utime(t._path(r.key), ns=(i * 10**9, i * 10**9))
    hit = rng.randrange(2)  # one of the two oldest
    assert t.get([recs[hit].key])[0].intact()  # now the most recent
    assert directory_bytes(tmp_path) == RECORDS * size and t.bound.evicted == 0
    assert t.put([recs[RECORDS]]) == [True]  # over the bound: down to 90% of it, the oldest first
    held = {i for i, r in enumerate(recs) if t._path(r.key).exists()}
    gone = sorted(set(range(RECORDS)) - {hit})[:2]
    assert held == set(range(RECORDS + 1)) - set(gone) and t.bound.evicted == 2
    assert directory_bytes(tmp_path) <= bound.LOW_WATER * RECORDS * size
    assert t.contains([recs[gone[0]].key]) == 0 and t.get([recs[gone[0]].key]) == [None]


def _write_bounded(directory: str, size: int, seed: int, evicted) -> None:
    t = bounded(directory, size)
    g = torch.Generator().manual_seed(seed)
    keys = prefix_keys(list(range(seed * 10**6, seed * 10**6 + 240)), 4, LAYOUT.model)
    for k in keys:
        assert t.put([TierPage.of(k, torch.randint(0, 256, (128,), dtype=torch.uint8, generator=g))]) == [True]
    evicted.value = t.bound.evicted


def test_the_bound_holds_with_two_processes_writing_one_directory(tmp_path, seed):
    size = record_bytes(tmp_path / "probe")
    shared = tmp_path / "shared"
    ctx = multiprocessing.get_context("spawn")
    evicted = [ctx.Value("i", -1) for _ in range(2)]
    procs = [ctx.Process(target=_write_bounded, args=(str(shared), size, seed * 2 + i, evicted[i])) for i in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    # within the bound but for what each wrote since it last looked (under SLACK of the bound each)
    assert directory_bytes(shared) <= RECORDS * size * (1 + 2 * bound.SLACK)
    assert all(e.value > 0 for e in evicted) and sum(e.value for e in evicted) >= 120 - RECORDS * 1.2
    left = [p for p in shared.rglob("*.kv")]
    reader = bounded(shared, size)
    keys = [p.name.removesuffix(".kv") for p in left]
    assert all(r is not None and r.intact() for r in reader.get(keys))
    assert not list(shared.rglob(".tmp-*"))


def test_a_record_evicted_under_a_reader_is_a_miss_not_an_error(tmp_path, seed, caplog):
    size = record_bytes(tmp_path / "probe")
    t, recs = bounded(tmp_path, size), records(4, seed)
    t.put(recs)
    keys = [r.key for r in recs]
    assert t.contains(keys) == 4
    other = bounded(tmp_path, size)
    real = FileTier._read
    evict_next = threading.Event()

    def racing(self, path):  # another engine's eviction lands between the lookup and the open
        if evict_next.is_set():
            os.unlink(path)
        return real(self, path)

    FileTier._read = racing
    try:
        evict_next.set()
        got = other.get(keys[2:3])
    finally:
        FileTier._read = real
    assert got == [None] and other.read_failures == 0 and other.rejected == 0
    with open(t._path(keys[0]), "rb") as f:  # one reading while it is deleted keeps a whole copy
        os.unlink(t._path(keys[0]))
        assert f.read() and t.get(keys[:1]) == [None]
    assert t.read_failures == 0 and not [r for r in caplog.records if r.levelname == "WARNING"]
