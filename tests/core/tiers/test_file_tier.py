"""The file cache tier: records round-trip through files, a foreign, garbled or truncated file is
never served as a record and is removed, a full disk refuses a write and serving goes on, several processes
writing one directory at once leave every record whole, and the existence check follows what another process
writes and deletes."""

from __future__ import annotations

import errno
import multiprocessing
import random

import torch

from engine.core.config import EngineConfig
from engine.core.families.cache_tier import TierContext, TierLayout, TierPage, prefix_keys
from engine.core.native.plugin import _file_reasons
from engine.core.tiers.file import FileTier

LAYOUT = TierLayout({"page": (96, 32)}, "test-model")


def tier(directory) -> FileTier:
    config = EngineConfig(model="-", enable_hierarchical_cache=True, hicache_storage_backend="file",
                          hicache_storage_dir=str(directory))
    return FileTier(TierContext(None, None, config, LAYOUT))


def records(n: int, seed: int) -> list[TierPage]:
    g = torch.Generator().manual_seed(seed)
    keys = prefix_keys(list(range(n * 4)), 4, LAYOUT.model)
    return [TierPage.of(k, torch.randint(0, 256, (128,), dtype=torch.uint8, generator=g)) for k in keys]


def test_records_round_trip_and_the_leading_ones_are_counted(tmp_path, seed):
    t, recs = tier(tmp_path), records(6, seed)
    assert t.put(recs[:4]) == [True] * 4
    assert t.contains([r.key for r in recs]) == 4 and t.contains([recs[5].key]) == 0
    got = t.get([r.key for r in recs])
    assert got[4] is None and got[5] is None
    for g, r in zip(got, recs):
        if g is not None:
            assert g.intact() and torch.equal(g.data, r.data) and (g.key, g.kind) == (r.key, r.kind)
    assert tier(tmp_path).get([recs[0].key])[0].intact()  # another engine on the same directory


def test_a_foreign_garbled_or_truncated_file_is_never_a_good_record(tmp_path, seed):
    rng = random.Random(seed)
    t, recs = tier(tmp_path), records(3, seed)
    t.put(recs)
    paths = [t._path(r.key) for r in recs]
    paths[0].write_bytes(paths[1].read_bytes())  # another key's record under this name
    paths[1].write_bytes(bytes(rng.randrange(256) for _ in range(200)))  # not a record at all
    raw = paths[2].read_bytes()
    paths[2].write_bytes(raw[:len(raw) - rng.randint(1, 100)])  # cut short
    foreign, garbled, truncated = t.get([r.key for r in recs])
    assert foreign is None and garbled is None and t.rejected == 2
    assert not paths[0].exists() and not paths[1].exists()  # removed: a good record may take their place
    assert not truncated.intact()
    t.reject(recs[2].key)  # what the hierarchy does with a record failing its checksum
    assert not paths[2].exists() and t.put(recs) == [True] * 3
    assert all(g.intact() for g in t.get([r.key for r in recs]))


def test_a_full_disk_refuses_the_write_and_leaves_nothing_behind(tmp_path, seed, monkeypatch):
    t, recs = tier(tmp_path), records(2, seed)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr("engine.core.tiers.file.os.replace", full)
    assert t.put(recs) == [False, False] and t.failed_writes == 2
    assert t.contains([recs[0].key]) == 0 and not [p for p in tmp_path.rglob("*") if p.is_file()]


def _write_all(directory: str, seed: int, order: int) -> None:
    t, recs = tier(directory), records(24, seed)
    random.Random(order).shuffle(recs)
    assert all(t.put(recs))


def test_processes_writing_one_directory_at_once_leave_every_record_whole(tmp_path, seed):
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_write_all, args=(str(tmp_path), seed, i)) for i in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    recs = records(24, seed)
    got = tier(tmp_path).get([r.key for r in recs])
    assert all(g is not None and g.intact() and torch.equal(g.data, r.data) for g, r in zip(got, recs))
    assert not list(tmp_path.rglob(".tmp-*"))


def _change(directory: str, seed: int, n: int, conn) -> None:
    """Another engine's process: writes (``put``) or deletes (as the size bound evicts: an unlink)
    the record asked for, answering once it has."""
    t, recs = tier(directory), records(n, seed)
    while (asked := conn.recv()) is not None:
        op, i = asked
        if op == "put":
            assert t.put([recs[i]]) == [True]
        else:
            t._path(recs[i].key).unlink()
        conn.send(op)


def test_the_existence_check_follows_what_another_process_writes_and_deletes(tmp_path, seed):
    """Each check after another process wrote or deleted a record of the run (this engine's own
    checks before it seeing the old state) counts the leading records there now: none found
    that is gone, none missed that came."""
    rng, n = random.Random(seed), 8
    t, keys = tier(tmp_path), [r.key for r in records(n, seed)]
    ours, theirs = multiprocessing.get_context("spawn").Pipe()
    other = multiprocessing.get_context("spawn").Process(target=_change, args=(str(tmp_path), seed, n, theirs))
    other.start()
    try:
        held: set[int] = set()
        for _ in range(40):
            first_missing = min(set(range(n)) - held, default=n)
            assert t.contains(keys) == first_missing
            if first_missing < n and (not held or rng.random() < 0.6):
                op, i = "put", first_missing if rng.random() < 0.8 else rng.choice(sorted(set(range(n)) - held))
            else:
                op, i = "delete", rng.choice(sorted(held))
            ours.send((op, i))
            assert ours.recv() == op
            held = held | {i} if op == "put" else held - {i}
        assert t.contains(keys) == min(set(range(n)) - held, default=n)
    finally:
        ours.send(None)
        other.join(60)
    assert other.exitcode == 0


def test_the_file_tier_refuses_without_a_writable_directory(tmp_path):
    def reasons(directory):
        config = EngineConfig(model="-", enable_hierarchical_cache=True, hicache_storage_backend="file",
                              hicache_storage_dir=directory)
        return _file_reasons(TierContext(None, None, config, LAYOUT))
    assert reasons(str(tmp_path / "new")) == []
    assert "names no directory" in reasons(None)[0]
    (tmp_path / "a-file").write_text("")
    assert "not a writable directory" in reasons(str(tmp_path / "a-file" / "sub"))[0]
