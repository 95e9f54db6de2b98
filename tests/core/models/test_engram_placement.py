"""Engram's tables in host memory (``engram_placement="host"``) against on the device, on the tiny
random V4.1 of test_dsv41 (Engram before layers 0 and 5), in fp32: the same rows reach the same
layers, so logits are equal bit for bit, packed or alone, in one step or cut at any offset (the
runner's ids before each chunk standing in for the device's n-gram cache), and the engine's
greedy tokens are equal through chunked prefill, prefix hits and preemption."""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.config import EngineConfig
from engine.core.models.deepseek_v4.engram import Rows
from engine.core.native.engram import ngram_rows
from engine.core.startup import build
from dsv41_random import random_v41_checkpoint, v41_config
from packed_logits import engine_logits
from test_dsv41 import TINY


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, run_seed, shared_dir):
    return random_v41_checkpoint(tmp_path_factory.mktemp("v41-engram"), run_seed, v41_config(**TINY),
                                 shared_dir / "models" / "tiny-dsv4-py")


@pytest.fixture(scope="module")
def placements(tiny):
    """The model built with each placement (fp32, pages of 4)."""
    return {p: build(EngineConfig(model=str(tiny), dtype="float32", page_size=4, num_pages=200, engram_placement=p),
                     progress=False) for p in ("device", "host")}


def _prompts(rng: random.Random, lengths: list[int]) -> list[list[int]]:
    return [[rng.randrange(128) for _ in range(n)] for n in lengths]


def test_host_rows_give_the_device_logits_at_any_cut_and_batch(placements, seed):
    rng = random.Random(seed)
    device, host = placements["device"], placements["host"]
    assert host.model.model.layers[5].engram.embed.weight.device.type == "cpu"
    assert len(host.kv.specs) == len(device.kv.specs) - 1  # no n-gram id cache: the host reads the ids
    prompts = _prompts(rng, [1, rng.randint(2, 9), rng.randint(10, 30), 33])
    for split in (None, rng.uniform(0.05, 0.5), rng.uniform(0.5, 0.95)):
        for got, want in zip(engine_logits(host, prompts, 4, split), engine_logits(device, prompts, 4, split)):
            assert torch.equal(got, want), split
    alone = [rng.choice(prompts[2:])]  # another batch: the rows follow each token, not its place in the batch
    cut = rng.uniform(0.05, 0.95)
    assert torch.equal(engine_logits(host, alone, 4, cut)[0], engine_logits(device, alone, 4, cut)[0])


def test_each_layer_reads_its_own_tables_rows(placements, seed):
    """The rows staged for a step, per registered layer, are that layer's table at its own hash."""
    rng = random.Random(seed)
    store = placements["host"].model.host_engram
    prompts = _prompts(rng, [rng.randint(1, 5), rng.randint(6, 20)])
    ids = [t for p in prompts for t in p]
    history = [[-1, -1], [-1, rng.randrange(128)]]
    with torch.inference_mode():  # as the runner stages
        store.stage(ids, [len(p) for p in prompts], history)
        ngrams = store.ngram_ids(ids, [len(p) for p in prompts], history)
        assert sorted(store.layers) == [0, 5]
        for layer_id, layer in store.layers.items():
            h = layer.hashing
            want = Rows.forward(layer.table, ngram_rows(ngrams, h.multipliers, h.primes, h.offsets))
            assert torch.equal(store.rows(layer_id, len(ids)), want), layer_id


def _greedy(tiny, prompts: list[list[int]], tokens: int, **engine) -> dict:
    """Each placement's greedy tokens of ``prompts`` (the first one also generated alone beforehand:
    its pages then serve prefix hits where prefix caching is on), and the host engine's outputs."""
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    got = {}
    for placement in ("device", "host"):  # the same steps: host placement reads every step's ids before the next
        llm = LLM(str(tiny), dtype="float32", progress=False, page_size=4, engram_placement=placement,
                  **({"overlap_decode": False} if placement == "device" else {}), **engine)
        assert not llm.engine.overlap
        first = llm.generate(prompts[:1], params)[0].outputs[0].token_ids
        outs = llm.generate(prompts, params)
        got[placement] = [first] + [o.outputs[0].token_ids for o in outs]
    return got | {"outputs": outs, "stats": llm.engine.stats()}


def test_host_placement_greedy_is_the_device_ones_over_chunks_and_prefix_hits(tiny, seed):
    rng = random.Random(seed)
    base = _prompts(rng, [rng.randint(9, 15)])[0]
    prompts = [base + p for p in _prompts(rng, [3, 11])] + _prompts(rng, [1, 26])
    got = _greedy(tiny, prompts, 5, chunked_prefill_size=5, num_pages=200)
    assert got["host"] == got["device"]
    assert got["outputs"][1].num_cached_tokens >= 8


def test_host_placement_greedy_is_the_device_ones_under_preemption(tiny, seed):
    """Too few pages for the whole batch (test_dsv41's recipe): sequences are preempted and recomputed."""
    got = _greedy(tiny, _prompts(random.Random(seed), [9, 17, 30, 23]), 8, num_pages=24,
                  enable_prefix_caching=False)
    assert got["host"] == got["device"]
    assert got["stats"].num_preemptions > 0


def test_a_bad_placement_is_refused_naming_the_field(tiny):
    with pytest.raises(ValueError, match="engram_placement must be one of device, host, got 'disk'"):
        EngineConfig(model=str(tiny), engram_placement="disk")
