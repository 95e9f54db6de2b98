"""Data-parallel attention on 2 GPUs over NCCL: tiny-dsv4-py (fp32) with the experts partitioned
gives the greedy tokens of one GPU, through chunked prefill and prefix hits; and on 4 GPUs as 2
data-parallel ranks, each rank's attention tensor-parallel over 2 of them. Skipped with fewer CUDA
devices (the CPU tests run the same over gloo)."""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams

from tp_helpers import TIMEOUT_S, within

pytestmark = pytest.mark.gpu

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
