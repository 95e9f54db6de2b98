"""A tiny random DeepSeek-V4.1 (CSA2 sharing, the candidate filter, Engram) on a GPU: the Triton V4
attention refuses it with the reason and the native oracle runs its attention on the device beside
the fast mHC, MoE, linear and norm backends, decoding eagerly; greedy tokens and logprobs agree with
the same model on the CPU in fp32, over chunked prefill, prefix hits and preemption."""

from __future__ import annotations

import logging
import random

import pytest

from engine import LLM, SamplingParams
from dsv41_random import random_v41_checkpoint, v41_config
from greedy_agreement import GreedyAgreement, compare_greedy

pytestmark = pytest.mark.gpu

TINY = dict(ratios=[0, 2, 2, 4, 1, 1, 1, 128, 1, 2, 2], kv_sources=[1, 4, 9], index_sources=[1, 4, 6], candidate=4,
            blocks=3, block_size=2, window=8, top_k=4, engram=[0, 5])
BOUND = 1e-3  # fp32 on both sides; TF32 off in the engine's fp32 paths


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, shared_dir):
    return random_v41_checkpoint(tmp_path_factory.mktemp("v41"), 0, v41_config(**TINY),
                                 shared_dir / "models" / "tiny-dsv4-py")


def test_the_oracle_runs_v41_on_the_gpu_as_on_the_cpu(tiny, seed, caplog):
    rng = random.Random(seed)
    stem = [rng.randrange(128) for _ in range(rng.randint(30, 60))]
    prompts = [stem] + [stem[:rng.randint(5, len(stem))] + [rng.randrange(128) for _ in range(rng.randint(1, 40))]
                        for _ in range(5)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)
    common = dict(dtype="float32", page_size=4, chunked_prefill_size=16, progress=False)
    with caplog.at_level(logging.INFO):
        gpu = LLM(str(tiny), device="cuda", num_pages=48, **common)  # few pages: preemption
    chosen = {f: s.chosen.name for f, s in gpu.engine.components.selections.items()}
    assert chosen["v4_attention"] == "native" and chosen["mhc"] == "triton", chosen
    assert "CSA2 layers" in caplog.text and "decode runs eagerly" in caplog.text
    cpu = LLM(str(tiny), device="cpu", num_pages=400, **common)
    agreement = GreedyAgreement()
    for got, want in zip(gpu.generate(prompts, params), cpu.generate(prompts, params)):
        g, w = got.outputs[0], want.outputs[0]
        agreement += compare_greedy(w.token_ids, w.logprobs, g.token_ids, g.logprobs, bound=BOUND)
    agreement.assert_most_sure()
