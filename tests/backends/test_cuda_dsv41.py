"""A tiny random DeepSeek-V4.1 (CSA2 sharing, the candidate filter, Engram) on a GPU, at head dims the
Triton V4 attention has configs for: the Triton V4 attention serves it beside the fast mHC, MoE,
linear and norm backends, decoding through graphs; greedy tokens and logprobs agree with the same
model on the CPU in fp32 (the native oracle), over chunked prefill, prefix hits and preemption, in
the model's dtype and in the published layout (E4M3 index keys); and ``engine plugins`` says the
Triton V4 attention runs its attention."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from engine import LLM, SamplingParams
from engine.core.models.deepseek_v4.publish import write_published
from dsv41_random import KERNEL_SHAPE, random_v41_checkpoint, v41_config
from greedy_agreement import GreedyAgreement, compare_greedy

pytestmark = pytest.mark.gpu

TINY = dict(ratios=[0, 2, 2, 4, 1, 1, 1, 128, 1, 2, 2], kv_sources=[1, 4, 9], index_sources=[1, 4, 6], candidate=4,
            blocks=3, block_size=2, window=8, top_k=4, engram=[0, 5], moe_intermediate_size=32)  # FP4: 32s
BOUND = 1e-3  # fp32 on both sides; TF32 off in the engine's fp32 paths


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, shared_dir):
    return random_v41_checkpoint(tmp_path_factory.mktemp("v41"), 0, {**v41_config(**TINY), **KERNEL_SHAPE},
                                 shared_dir / "models" / "tiny-dsv4-py")


@pytest.mark.parametrize("published", [False, True])
def test_triton_runs_v41_on_the_gpu_as_the_oracle_on_the_cpu(tiny, tmp_path, seed, published):
    path, linear = tiny, {}
    if published:  # V4.1's blocks of 32: E4M3 index keys derived by an FP8 projection
        write_published(tiny, tmp_path / "published", block=32)
        # its linears, wo_a and shared expert kept in 32 x 32 blocks: the native linear and MoE, whose
        # unquantized activations the CPU oracle's are (the Triton kernels' E4M3 ones, and decode from
        # graphs with them: test_triton_block_fp8_model's V4.1 tests, test_triton_moe_one_launch)
        path, linear = tmp_path / "published", {"linear_backend": "native", "moe_backend": "native"}
    rng = random.Random(seed)
    stem = [rng.randrange(128) for _ in range(rng.randint(30, 60))]
    prompts = [stem] + [stem[:rng.randint(5, len(stem))] + [rng.randrange(128) for _ in range(rng.randint(1, 40))]
                        for _ in range(5)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)
    common = dict(dtype="float32", page_size=4, chunked_prefill_size=16, progress=False)
    gpu = LLM(str(path), device="cuda", num_pages=48, **linear, **common)  # few pages: preemption
    chosen = {f: s.chosen.name for f, s in gpu.engine.components.selections.items()}
    assert chosen["v4_attention"] == chosen["mhc"] == "triton", chosen
    assert chosen["graphs"] == "cuda_graphs", chosen
    cpu = LLM(str(path), device="cpu", num_pages=400, **common)
    agreement = GreedyAgreement()
    for got, want in zip(gpu.generate(prompts, params), cpu.generate(prompts, params)):
        g, w = got.outputs[0], want.outputs[0]
        agreement += compare_greedy(w.token_ids, w.logprobs, g.token_ids, g.logprobs, bound=BOUND)
    agreement.assert_most_sure()


def test_plugins_says_triton_serves_v41_attention(tiny):
    res = subprocess.run([sys.executable, "-m", "engine.server.cli", "plugins", "--model", str(tiny)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    blocks = res.stdout[res.stdout.index("Blocks of DeepseekV4ForCausalLM"):].splitlines()
    assert any("indexer top-k" in line and line.rstrip().endswith("v4_attention backend triton") for line in blocks)
