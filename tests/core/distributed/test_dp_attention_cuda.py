"""Data-parallel attention on 2 GPUs over NCCL: tiny-dsv4-py (fp32) with the experts partitioned
gives the greedy tokens of one GPU, through chunked prefill and prefix hits; and on 4 GPUs as 2
data-parallel ranks, each rank's attention tensor-parallel over 2 of them; speculative decoding
(n-gram, MTP) on 2 GPUs after the start-up warm-up. Skipped with fewer CUDA devices (the CPU tests
run the same over gloo)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams

from tp_helpers import TIMEOUT_S, within

pytestmark = pytest.mark.gpu
ASSETS = Path(__file__).parents[2] / "assets"

OPTS = dict(device="cuda", dtype="float32", page_size=16, chunked_prefill_size=64, max_model_len=1024,
            num_pages=256, progress=False)


@pytest.mark.parametrize("gpus,dp", [(2, 2), (4, 2)])
def test_gpus_serve_their_own_requests_as_one_gpu_does(dsv4, run_seed, gpus, dp):
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} CUDA devices")
    rng = random.Random(run_seed)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    one = LLM(dsv4, **OPTS)
    batch = [[rng.randrange(3, one.engine.vocab_size) for _ in range(rng.randint(100, 400))] for _ in range(8)]
    expected = [o.outputs[0].token_ids for o in one.generate(batch, params)]
    again = [p + e for p, e in zip(batch, expected)]
    expected_again = [o.outputs[0].token_ids for o in one.generate(again, params)]
    llm = within(TIMEOUT_S * 4, lambda: LLM(dsv4, tensor_parallel_size=gpus, data_parallel_size=dp,
                                            enable_dp_attention=True, expert_parallel=True,
                                            distributed_timeout=TIMEOUT_S, **OPTS))
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(batch, params)] == expected
        assert [o.outputs[0].token_ids for o in llm.generate(again, params)] == expected_again
        assert llm.engine.stats().prefix_cache_hits > llm.engine.kv_manager.stats().prefix_hits > 0
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_ranks_speculate_after_warming_up_in_step(dsv4, eval_text, run_seed, method):
    """2 GPUs, decode, verify and prefill graphs (the ranks agreeing on one graph and bucket each
    step, core/graph_choice.py) and MTP's drafting forwards agreed across the ranks, after the
    default warm-up: the greedy tokens of one GPU without speculation, drafts on both ranks, verify
    steps replaying verify graphs on rank 0."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    rng = random.Random(run_seed)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    one = LLM(dsv4, enforce_eager=True, **OPTS)
    starts = [rng.randrange(len(eval_text) - 4000) for _ in range(6)]
    passages = [one.tokenizer.encode(eval_text[s:s + 4000])[:rng.randint(60, 200)] for s in starts]
    batch = [p + p[:len(p) // 3] for p in passages]  # a passage and its start again: a copying model drafts well
    expected = [o.outputs[0].token_ids for o in one.generate(batch, params)]
    spec = {"method": method, "num_speculative_tokens": 3}
    spec.update({"model": str(ASSETS / "tiny-dsv4-py-mtp")} if method == "mtp" else
                {"prompt_lookup_min": 1, "prompt_lookup_max": 3})
    llm = within(TIMEOUT_S * 4, lambda: LLM(dsv4, tensor_parallel_size=2, data_parallel_size=2,
                                            enable_dp_attention=True, expert_parallel=True, speculative_config=spec,
                                            distributed_timeout=TIMEOUT_S, **OPTS))
    try:
        runner = llm.engine.runner
        assert llm.engine.warmup is not None and runner.graphs is not None
        assert runner.verify_graphs is not None and runner.prefill_graphs is not None
        verified = []
        run = runner.verify_graphs.run
        runner.verify_graphs.run = lambda *a: verified.append(a[4]) or run(*a)
        assert [o.outputs[0].token_ids for o in llm.generate(batch, params)] == expected
        assert verified, "no verify step replayed a verify graph"
        assert llm.engine.stats().spec.num_draft_tokens > llm.engine.speculator.counters.num_draft_tokens > 0
    finally:
        llm.engine.shutdown()
