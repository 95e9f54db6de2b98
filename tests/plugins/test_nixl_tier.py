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
