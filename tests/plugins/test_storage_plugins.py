"""The NIXL and Mooncake storage tiers (plugins/): registered through entry points like third-party
code, refused with the reason where their library is missing (it is here), so an engine that
names one fails at start-up saying why; the Mooncake tier's own logic against a stand-in store."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import random
import sys
import types

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.config import EngineConfig
from engine.core.families.cache_tier import TierContext, TierLayout, TierPage
from engine.core.plugins import load_plugins
from engine.core.registry import SelectionError
from engine.core.startup import build
from engine.plugins import mooncake, nixl

LAYOUT = TierLayout({"page": (64,)}, "test-model")


def plugins():
    """The installed plugins, with these two registered as their entry points register them."""
    p = load_plugins()
    for name, module in (("nixl", nixl), ("mooncake", mooncake)):
        if not p.pm.has_plugin(name):
            p.pm.register(module, name=name)
    return p


def second_engine_hits_the_first(model_dir, seed: int, backend: str, stored=None, **store) -> None:
    """A prompt run on one engine with the storage tier ``backend`` (configured by ``store``), its
    records written (``stored``, where given, is called with their count); a second engine on the
    same store hits its 100 tokens there and decodes as an engine without tiers, every page
    accounted for."""
    rng = random.Random(seed)
    prompt = [rng.randrange(4096) for _ in range(100)]
    follow = prompt + [rng.randrange(4096) for _ in range(5)]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    plain = dict(dtype="float32", progress=False, page_size=4, num_pages=40)
    tiered = dict(plain, enable_hierarchical_cache=True, hicache_storage_backend=backend,
                  hicache_storage_prefetch_threshold=64, hicache_storage_prefetch_policy="wait_complete", **store)
    engines = [LLM(str(model_dir), **tiered)]
    try:  # each engine's storage writer stopped before the store may go
        engines[0].generate([prompt], params)
        assert engines[0].engine.kv_manager.lower.flush_storage(30)  # written on the storage writer's thread
        written = engines[0].engine.kv_manager.lower.stats.storage_written
        assert written >= 25
        if stored is not None:
            stored(written)
        engines.append(LLM(str(model_dir), **tiered))
        out = engines[1].generate([follow], params)[0]
        assert out.num_cached_tokens == engines[1].engine.kv_manager.lower.stats.storage_hit_tokens == 100
        assert out.outputs[0].token_ids == LLM(str(model_dir), **plain).generate([follow], params)[0].outputs[0].token_ids
        engines[1].engine.kv_manager.check_consistency()
    finally:
        for llm in engines:
            llm.engine.shutdown()


def context(tmp_path, backend: str, **options) -> TierContext:
    config = EngineConfig(model="-", enable_hierarchical_cache=True, hicache_storage_backend=backend,
                          hicache_storage_dir=str(tmp_path), **options)
    return TierContext(None, None, config, LAYOUT)


@pytest.mark.skipif(any(m in sys.modules or importlib.util.find_spec(m) for m in ("nixl", "mooncake")),
                    reason="a library is installed here")
@pytest.mark.parametrize("backend, reason", [
    ("nixl", r"nixl package is not installed \(pip install nixl\)"),
    ("mooncake", r"mooncake store is not installed \(pip install 'engine\[mooncake\]', or "
                 r"mooncake-transfer-engine on a CUDA host\).*no Mooncake master")])
def test_a_missing_library_is_refused_with_the_reason(tmp_path, backend, reason):
    with pytest.raises(SelectionError, match=reason):
        plugins().select("cache_tier", context(tmp_path, backend), backend)


@pytest.mark.skipif(importlib.util.find_spec("mooncake") is not None, reason="mooncake is installed here")
def test_an_engine_naming_a_missing_backend_fails_at_start_up_saying_why(tiny_qwen3, tmp_path):
    config = EngineConfig(model=str(tiny_qwen3), num_pages=16, enable_hierarchical_cache=True,
                          hicache_storage_backend="mooncake")
    with pytest.raises(SelectionError, match="mooncake store is not installed"):
        build(config, plugins(), progress=False)


class FakeStore:
    """Mooncake's store API over a dict (setup, put, get, is_exist), one instance per 'cluster'."""

    data: dict[str, bytes] = {}
    down = False  # every read raises, as an unreachable store's client does

    def setup(self, *args):
        self.args = args
        return 0

    def put(self, key, value):
        self.data[key] = bytes(value)
        return 0

    def get(self, key):
        if self.down:
            raise RuntimeError("the master is unreachable")
        return self.data.get(key, b"")

    def is_exist(self, key):
        if self.down:
            raise RuntimeError("the master is unreachable")
        return int(key in self.data)

    def remove(self, key):
        return 0 if self.data.pop(key, None) is not None else -1


@pytest.fixture
def fake_mooncake(monkeypatch):
    pkg, store = types.ModuleType("mooncake"), types.ModuleType("mooncake.store")
    pkg.__spec__ = importlib.machinery.ModuleSpec("mooncake", None)
    store.MooncakeDistributedStore = FakeStore
    pkg.store = store
    monkeypatch.setitem(sys.modules, "mooncake", pkg)
    monkeypatch.setitem(sys.modules, "mooncake.store", store)
    FakeStore.data, FakeStore.down = {}, False
    return FakeStore


def test_the_mooncake_tier_round_trips_records_refuses_and_removes_bad_ones_and_counts_failed_reads(
        tmp_path, seed, fake_mooncake, monkeypatch):
    monkeypatch.setenv("MOONCAKE_MASTER", "env-host:1")
    ctx = context(tmp_path, "mooncake", plugin_options={"mooncake": {"master_server_address": "master:50051"}})
    assert mooncake.mooncake_reasons(ctx) == []
    tier = plugins().select("cache_tier", ctx, "mooncake").create(ctx)
    assert tier.store.args[-1] == "master:50051"  # the option wins over the environment
    recs = [TierPage.of(f"k{i}", torch.randint(0, 256, (64,), dtype=torch.uint8)) for i in range(4)]
    assert tier.put(recs[:3]) == [True] * 3 and tier.contains([r.key for r in recs]) == 3
    got = tier.get([r.key for r in recs])
    assert got[3] is None and all(g.intact() and torch.equal(g.data, r.data) for g, r in zip(got[:3], recs))
    fake_mooncake.data["k0"] = fake_mooncake.data["k1"]  # the store hands back another key's record
    assert tier.get(["k0"]) == [None] and tier.rejected == 1
    assert "k0" not in fake_mooncake.data  # removed: a good record may take its place
    tier.reject("k1")  # what the hierarchy does with a record failing its checksum
    assert "k1" not in fake_mooncake.data
    fake_mooncake.down = True  # reads fail: counted misses, nothing raised
    assert tier.get(["k2"]) == [None] and tier.contains(["k2"]) == 0 and tier.read_failures == 2
