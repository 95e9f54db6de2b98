"""The NIXL storage tier over NIXL's POSIX file plugin, where the optional nixl package is installed
(skipped otherwise, as in CI): records round-trip through NIXL in the file tier's layout, so a
file tier on the same directory reads what NIXL wrote and the other way round; a damaged file is
a miss and is removed; an engine hits what another engine stored through NIXL and decodes as an
engine without tiers does."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("nixl", reason="nixl is not installed (pip install 'engine[nixl]')")

from engine.core.families.cache_tier import TierPage  # noqa: E402
from engine.core.tiers.file import FileTier  # noqa: E402
from engine.plugins import nixl  # noqa: E402
from test_storage_plugins import context, plugins, second_engine_hits_the_first  # noqa: E402


@pytest.fixture(autouse=True)
def posix_only(monkeypatch):
    monkeypatch.setattr(nixl, "FILE_PLUGINS", ("POSIX",))


def test_records_round_trip_through_posix_and_the_file_tier_shares_the_directory(tmp_path, seed):
    ctx = context(tmp_path, "nixl")
    tier = plugins().select("cache_tier", ctx, "nixl").create(ctx)
    assert tier.plugin == "POSIX"
    recs = [TierPage.of(f"{i:02x}" * 16, torch.randint(0, 256, (64,), dtype=torch.uint8)) for i in range(6)]
    assert tier.put(recs[:3]) == [True] * 3
    files = FileTier(ctx)
    assert files.put(recs[3:5]) == [True] * 2
    for reader in (tier, files):  # each reads what either wrote
        got = reader.get([r.key for r in recs])
        assert got[5] is None and all(g.intact() and torch.equal(g.data, r.data) for g, r in zip(got[:5], recs))
    assert tier.contains([r.key for r in recs]) == 5
    path = tier._path(recs[1].key)
    path.write_bytes(path.read_bytes()[:-3])  # cut short: read whole, it fails its checksum
    assert not tier.get([recs[1].key])[0].intact()
    path.write_bytes(b"not a record")
    assert tier.get([recs[1].key]) == [None] and tier.rejected == 1 and not path.exists()


def test_an_engine_hits_what_another_stored_through_nixl(tiny_qwen3, tmp_path, seed):
    second_engine_hits_the_first(tiny_qwen3, seed, "nixl", hicache_storage_dir=str(tmp_path))


def test_a_get_of_many_records_is_one_transfer_and_a_gone_or_cut_file_fails_only_itself(tmp_path, seed):
    import random

    rng = random.Random(seed)
    ctx = context(tmp_path, "nixl")
    tier = plugins().select("cache_tier", ctx, "nixl").create(ctx)
    recs = [TierPage.of(f"{i:02x}" * 16, torch.randint(0, 256, (rng.randint(4, 300),), dtype=torch.uint8))
            for i in range(rng.randint(8, 16))]
    assert tier.put(recs) == [True] * len(recs)
    gone, cut = rng.sample(range(1, len(recs) - 1), 2)
    tier._path(recs[gone].key).unlink()
    path = tier._path(recs[cut].key)
    path.write_bytes(path.read_bytes()[:-rng.randint(1, 3)])  # within its data (4 bytes or more)
    posted = []
    post = tier.store.post
    tier.store.post = lambda *args: posted.append(args[3]) or post(*args)
    got = tier.get([r.key for r in recs])
    assert len(posted) == 1 and len(posted[0]) == len(recs) - 1  # one request, a descriptor a file there
    assert got[gone] is None and not got[cut].intact() and tier.read_failures == tier.rejected == 0
    assert all(g.intact() and torch.equal(g.data, r.data)
               for i, (g, r) in enumerate(zip(got, recs)) if i not in (gone, cut))
