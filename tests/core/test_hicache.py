"""The hierarchical cache end to end on the trained tiny checkpoints: a prompt whose prefix the
device evicted but host memory kept hits there (counted, fewer tokens computed) and decodes
greedily exactly as an engine without the hierarchy does; a corrupted host record is caught and
its tokens recomputed; no page or record is left behind."""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import random
import subprocess
import sys
import threading

import pytest

from engine import LLM, SamplingParams
from engine.core.config import EngineConfig
from engine.core.kv.host_copy import HostCopy
from engine.core.tiers.file import FileTier
from engine.server import wire
from engine.server.engine_args import add_engine_args, engine_config
from engine.server.metrics import ServerMetrics

PARAMS = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def workload(seed: int) -> list[list[int]]:
    """A prompt, an unrelated longer one that pushes it off a small device cache, the first again
    with a few more tokens."""
    rng = random.Random(seed)
    first, other = ([rng.randrange(4096) for _ in range(n)] for n in (100, 130))
    return [first, other, first + [rng.randrange(4096) for _ in range(5)]]


def run(path, prompts, corrupt: bool = False, **hicache):
    """Each prompt alone, in order, on a device cache of 40 pages of 4 tokens; the outputs and the engine."""
    llm = LLM(str(path), dtype="float32", progress=False, page_size=4, num_pages=40, **hicache)
    outs = []
    for i, p in enumerate(prompts):
        lower = llm.engine.kv_manager.lower
        if corrupt and i == len(prompts) - 1:  # one record of the first prompt's pages, flipped in host memory
            node = next(n for n in llm.engine.kv_manager.radix.lower_nodes() if n.key[:4] == tuple(p[:4]))
            lower.tier.corrupt(node.lower[len(node.lower) // 2], 3)
        outs.append(llm.generate([p], PARAMS)[0])
    return outs, llm


@pytest.fixture(scope="module")
def without_hierarchy(shared_dir, run_seed):
    """Per model, the workload and its outputs on the same small device cache without the hierarchy."""
    done = {}

    def get(model: str):
        if model not in done:
            prompts = workload(run_seed)
            done[model] = prompts, run(shared_dir / "models" / model, prompts)[0]
        return done[model]
    return get


@pytest.mark.parametrize("model", ["tiny-qwen3-py", "tiny-dsv4-py"])
@pytest.mark.parametrize("policy,layout", [("write_through", "layer_first"), ("write_back", "page_first")])
def test_a_prefix_evicted_to_host_memory_hits_there_and_decodes_the_same(shared_dir, without_hierarchy, model,
                                                                        policy, layout):
    path = shared_dir / "models" / model
    prompts, plain = without_hierarchy(model)
    tiered, llm = run(path, prompts, enable_hierarchical_cache=True, hicache_write_policy=policy,
                      hicache_mem_layout=layout)
    assert [o.outputs[0].token_ids for o in tiered] == [o.outputs[0].token_ids for o in plain]
    assert plain[2].num_cached_tokens == 0, "the small device cache was meant to lose the first prompt"
    assert tiered[2].num_cached_tokens == 100
    kv = llm.engine.kv_manager
    assert kv.lower.stats.hit_tokens == 100 and kv.lower.stats.checksum_failures == 0
    loads = llm.engine.components.kv.loads  # the one load went layer by layer beside its forward
    assert loads.layer_copies == len(loads.columns) > 0
    kv.reset_prefix_cache()
    kv.check_consistency()
    assert kv.stats().num_used == 0 and kv.stats().num_window_used == 0 and not kv.lower.tier.keys()


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["tiny-qwen3-py", "tiny-dsv4-py"])
def test_on_cuda_a_host_hit_loads_layer_by_layer_on_a_copy_stream_and_decodes_the_same(shared_dir, model, run_seed):
    """Pinned host memory, the copy stream and one event per layer: greedy output as without the hierarchy."""
    path = shared_dir / "models" / model
    prompts = workload(run_seed)
    plain, _ = run(path, prompts, device="cuda")
    tiered, llm = run(path, prompts, device="cuda", enable_hierarchical_cache=True)
    assert [o.outputs[0].token_ids for o in tiered] == [o.outputs[0].token_ids for o in plain]
    assert plain[2].num_cached_tokens == 0 and tiered[2].num_cached_tokens == 100
    loads = llm.engine.components.kv.loads
    assert loads._stream is not None and loads.layer_copies == len(loads.columns) > 0
    llm.engine.kv_manager.check_consistency()


@pytest.mark.parametrize("model", ["tiny-qwen3-py", "tiny-dsv4-py"])
def test_a_corrupted_host_record_is_recomputed_not_served(shared_dir, without_hierarchy, model):
    path = shared_dir / "models" / model
    prompts, plain = without_hierarchy(model)
    tiered, llm = run(path, prompts, corrupt=True, enable_hierarchical_cache=True, hicache_write_policy="write_back")
    assert [o.outputs[0].token_ids for o in tiered] == [o.outputs[0].token_ids for o in plain]
    kv = llm.engine.kv_manager
    assert kv.lower.stats.checksum_failures == 1 and tiered[2].num_cached_tokens < 100
    kv.check_consistency()


def test_a_store_that_fills_up_is_detached_logged_once_and_serving_goes_on(shared_dir, without_hierarchy, tmp_path,
                                                                          monkeypatch, caplog, seed):
    """The storage directory runs out of space (ENOSPC) after a few records: the failure is counted,
    logged once, the tier detached; host memory still serves the hit and the output is unchanged."""
    rng = random.Random(seed)
    room, written = rng.randint(0, 20), []
    real = FileTier._write

    def full_disk(self, fd, blob):
        if len(written) >= room:
            os.close(fd)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        written.append(len(blob))
        real(self, fd, blob)

    monkeypatch.setattr(FileTier, "_write", full_disk)
    prompts, plain = without_hierarchy("tiny-qwen3-py")
    with caplog.at_level(logging.WARNING, logger="engine.core.kv.hierarchy"):
        tiered, llm = run(shared_dir / "models" / "tiny-qwen3-py", prompts, enable_hierarchical_cache=True,
                          hicache_storage_backend="file", hicache_storage_dir=str(tmp_path))
        assert llm.engine.kv_manager.lower.flush_storage(10)  # the writes land on the writer's thread
    assert [o.outputs[0].token_ids for o in tiered] == [o.outputs[0].token_ids for o in plain]
    assert tiered[2].num_cached_tokens == 100  # from host memory
    kv = llm.engine.kv_manager
    assert kv.lower.reader is None and kv.lower.stats.storage_written == room and kv.lower.stats.storage_refused > 0
    warnings = [r for r in caplog.records if r.name == "engine.core.kv.hierarchy"]
    assert len(warnings) == 1 and "No space left" in warnings[0].getMessage()
    assert len(list(tmp_path.rglob("*.kv"))) == room and not list(tmp_path.rglob(".tmp-*"))
    stats = llm.engine.stats().hicache
    assert stats.storage_backend is None and stats.storage_failures == kv.lower.stats.storage_refused
    text = ServerMetrics("m", 4, 40).render(wire.Stats(hicache=stats), 0)
    assert f'engine:hicache_storage_failures_total{{model_name="m"}} {stats.storage_failures}' in text
    assert stats.storage_dropped == kv.lower.storage_dropped()  # queued after the failure
    assert f'engine:hicache_storage_dropped_total{{model_name="m"}} {stats.storage_dropped}' in text
    assert 'engine:hicache_storage_attached{model_name="m",backend=""} 0' in text
    kv.check_consistency()


def test_a_slow_store_holds_up_no_step_and_its_records_land_later(shared_dir, without_hierarchy, tmp_path,
                                                                  monkeypatch):
    """Every storage write hangs until released: the workload runs through (the engine loop hands
    the writes over and goes on), decodes as without the hierarchy, hits host memory, and leaves
    no record in storage yet; released, they land, and closing the engine leaves nothing queued."""
    go, real = threading.Event(), FileTier._write

    def slow(self, fd, parts):
        go.wait(60)
        real(self, fd, parts)

    monkeypatch.setattr(FileTier, "_write", slow)
    prompts, plain = without_hierarchy("tiny-qwen3-py")
    tiered, llm = run(shared_dir / "models" / "tiny-qwen3-py", prompts, enable_hierarchical_cache=True,
                      hicache_storage_backend="file", hicache_storage_dir=str(tmp_path))
    assert [o.outputs[0].token_ids for o in tiered] == [o.outputs[0].token_ids for o in plain]
    assert tiered[2].num_cached_tokens == 100  # from host memory
    lower = llm.engine.kv_manager.lower
    assert not list(tmp_path.rglob("*.kv")) and lower.stats.storage_written == 0
    llm.engine.kv_manager.check_consistency()
    go.set()
    llm.engine.shutdown()
    landed = len(list(tmp_path.rglob("*.kv")))
    assert landed == lower.stats.storage_written == lower.stats.written_pages - lower.storage_dropped() > 0


def test_copies_still_on_their_way_land_once_the_engine_has_nothing_to_run(shared_dir, without_hierarchy,
                                                                           monkeypatch):
    """Every copy to host memory reports itself not yet landed (as a GPU's behind a long step): the
    engine goes on stepping, and once the workload is done and nothing runs, every record written
    is in host memory, with no later request needed to carry it there."""
    monkeypatch.setattr(HostCopy, "ready", lambda self: False)
    prompts, plain = without_hierarchy("tiny-qwen3-py")
    tiered, llm = run(shared_dir / "models" / "tiny-qwen3-py", prompts[:2], enable_hierarchical_cache=True)
    assert [o.outputs[0].token_ids for o in tiered] == [o.outputs[0].token_ids for o in plain[:2]]
    lower = llm.engine.kv_manager.lower
    assert lower.stats.written_pages > 0 and len(lower.tier.keys()) == lower.stats.written_pages
    llm.engine.kv_manager.check_consistency()


def test_the_flags_reach_the_config_and_bad_values_are_refused(tiny_qwen3):
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--model", str(tiny_qwen3), "--enable-hierarchical-cache", "--hicache-size", "1.5",
                              "--hicache-write-policy", "write_through_selective", "--hicache-mem-layout", "page_first",
                              "--hicache-storage-max-size", "2.5"])
    c = engine_config(args)
    assert (c.enable_hierarchical_cache, c.hicache_size, c.hicache_write_policy, c.hicache_mem_layout,
            c.hicache_storage_max_size) == (True, 1.5, "write_through_selective", "page_first", 2.5)
    with pytest.raises(SystemExit):
        parser.parse_args(["--hicache-write-policy", "write_around"])
    for bad, match in [(dict(hicache_write_policy="write_around"), "hicache_write_policy"),
                       (dict(hicache_mem_layout="token_first"), "hicache_mem_layout"),
                       (dict(hicache_ratio=0), "hicache_ratio"),
                       (dict(hicache_storage_max_size=-1), "hicache_storage_max_size"),
                       (dict(enable_hierarchical_cache=True, enable_prefix_caching=False), "prefix caching")]:
        with pytest.raises(ValueError, match=match):
            EngineConfig(model="m", **bad)


ENGINE_PROCESS = """
import json, sys
from engine import LLM, SamplingParams
path, directory, prompt = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
llm = LLM(path, dtype="float32", progress=False, page_size=4, num_pages=40, enable_hierarchical_cache=True,
          hicache_storage_backend="file", hicache_storage_dir=directory, hicache_storage_prefetch_threshold=64,
          hicache_storage_prefetch_policy="wait_complete")
out = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
llm.engine.kv_manager.lower.flush_storage(60)
s = llm.engine.kv_manager.lower.stats
print(json.dumps([out.outputs[0].token_ids, out.num_cached_tokens, s.storage_hit_tokens, s.storage_written]))
"""


def engine_process(path, directory, prompt) -> list:
    """One engine in a process of its own, sharing ``directory``: its tokens, hit and storage counters."""
    res = subprocess.run([sys.executable, "-c", ENGINE_PROCESS, str(path), str(directory), json.dumps(prompt)],
                         capture_output=True, text=True, timeout=300, env=os.environ)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("model", ["tiny-qwen3-py", "tiny-dsv4-py"])
def test_a_second_engine_process_hits_what_the_first_stored(shared_dir, without_hierarchy, model, tmp_path):
    """Two engines in two processes, one after the other, on one storage directory: the second
    finds the first's prompt there (counted) and decodes greedily as an engine without any tier."""
    path = shared_dir / "models" / model
    prompts, plain = without_hierarchy(model)
    first = engine_process(path, tmp_path, prompts[0])
    assert first[0] == plain[0].outputs[0].token_ids and first[3] > 0 and first[1] == 0
    tokens, cached, storage_hits, _ = engine_process(path, tmp_path, prompts[2])
    assert cached == storage_hits == 100
    assert tokens == plain[2].outputs[0].token_ids


def test_the_warm_up_leaves_nothing_in_storage(shared_dir, tmp_path, seed):
    """The start-up warm-up's made-up prompts never reach a directory other engines share; the tier
    is attached again after it and takes the first real prompt's pages."""
    llm = LLM(str(shared_dir / "models" / "tiny-qwen3-py"), dtype="float32", progress=False, page_size=4, num_pages=40,
              warmup=True, enable_hierarchical_cache=True, hicache_storage_backend="file",
              hicache_storage_dir=str(tmp_path))
    assert llm.engine.warmup is not None and llm.engine.warmup.steps > 0
    assert not list(tmp_path.rglob("*.kv")) and llm.engine.kv_manager.lower.reader is not None
    rng = random.Random(seed)
    llm.generate([[rng.randrange(4096) for _ in range(40)]], PARAMS)
    assert len(list(tmp_path.rglob("*.kv"))) >= 10
