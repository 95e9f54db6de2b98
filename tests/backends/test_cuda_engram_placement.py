"""Engram's tables in pinned host memory against on the device, on a GPU with decode graphs: a tiny
random V4.1 with Engram at two layers and V4's sliding, CSA and HCA layers (no CSA2, so the Triton
V4 attention runs and decode steps replay captured graphs) gives the same greedy tokens and
logprobs with either placement, the rows prefetched on the side stream or copied before the step,
over chunked prefill, prefix hits and preemption."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from dsv41_random import random_v41_checkpoint, v41_config

pytestmark = pytest.mark.gpu

# the Triton V4 attention's head dim (64), tiny-dsv4-py's index head dim and window; Engram before layers 1 and 3
SHAPE = {"head_dim": 64, "qk_rope_head_dim": 16, "index_head_dim": 32, "index_n_heads": 16, "sliding_window": 64}
BOUND = 1e-3  # the same kernels on the same rows: equal to the bit unless a kernel's sum order is not fixed


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, shared_dir):
    hf = {**v41_config([0, 4, 128, 4, 0], [], [], engram=[1, 3]), **SHAPE}
    return random_v41_checkpoint(tmp_path_factory.mktemp("v41-engram-cuda"), 0, hf,
                                 shared_dir / "models" / "tiny-dsv4-py")


def test_host_placement_decodes_as_device_placement_through_graphs(tiny, seed):
    rng = random.Random(seed)
    stem = [rng.randrange(128) for _ in range(rng.randint(30, 60))]
    prompts = [stem] + [stem[:rng.randint(5, len(stem))] + [rng.randrange(128) for _ in range(rng.randint(1, 40))]
                        for _ in range(7)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=2)
    common = dict(device="cuda", dtype="bfloat16", page_size=4, chunked_prefill_size=16, num_pages=36,
                  overlap_decode=False, progress=False)  # few pages: preemption
    outs, replays = {}, {}
    for placement in ("device", "host", "host_no_prefetch"):
        llm = LLM(str(tiny), engram_placement=placement.removesuffix("_no_prefetch"), **common)
        c = llm.engine.components
        assert c.selections["v4_attention"].chosen.name == "triton" and c.graphs is not None
        model = c.model
        if placement != "device":
            table = model.model.layers[3].engram.embed.weight
            assert table.device.type == "cpu" and table.is_pinned()
            model.host_engram.prefetch = placement == "host"
        graphs, count = c.graphs, [0]
        run = graphs.run
        graphs.run = lambda *a, **k: (count.__setitem__(0, count[0] + 1), run(*a, **k))[1]
        outs[placement] = llm.generate(prompts, params)
        replays[placement] = count[0]
        if placement == "host":
            assert llm.engine.stats().num_preemptions > 0
        del llm
    assert all(n > 0 for n in replays.values()), replays
    for placement in ("host", "host_no_prefetch"):
        for got, want in zip(outs[placement], outs["device"]):
            g, w = got.outputs[0], want.outputs[0]
            assert g.token_ids == w.token_ids, placement
            for gl, wl in zip(g.logprobs, w.logprobs):
                assert all(abs(gl[t] - wl[t]) <= BOUND for t in wl if t in gl), placement
