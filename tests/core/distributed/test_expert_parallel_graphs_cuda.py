"""Decode and prefill steps replay CUDA graphs with the MoE all_to_all inside (the padded dispatch,
sized by the decode batch or the prefill token bucket): on 2 GPUs over NCCL, tiny-dsv4-py and a
tiny Qwen3-MoE with the experts partitioned (expert parallel), and tiny-dsv4-py under
data-parallel attention (each rank its own requests, the ranks agreeing on one graph and bucket
every step, a rank with fewer sequences or tokens or none replaying padding), give the greedy
tokens of one GPU, as do the same engines run eagerly. Skipped with fewer than 2 CUDA devices (the
CPU tests check the padded exchange against the exact one, and its replay on the host graphs)."""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.checkpoints import write_checkpoint

from tp_helpers import TIMEOUT_S, within

pytestmark = pytest.mark.gpu

OPTS = dict(device="cuda", dtype="float32", page_size=16, chunked_prefill_size=64, max_model_len=1024,
            num_pages=256, max_num_seqs=16, progress=False)
PARALLEL = {"ep2": dict(tensor_parallel_size=2, expert_parallel=True),
            "dp2-ep2": dict(tensor_parallel_size=2, data_parallel_size=2, enable_dp_attention=True,
                            expert_parallel=True)}


@pytest.mark.parametrize("which,parallel", [("dsv4", "ep2"), ("qwen3-moe", "ep2"), ("dsv4", "dp2-ep2")])
def test_graphed_expert_parallel_decode_gives_the_tokens_of_one_gpu(which, parallel, dsv4, tmp_path, run_seed):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    model = dsv4 if which == "dsv4" else write_checkpoint(tmp_path / "moe", "tiny-qwen3-moe", dtype=torch.float32,
                                                          progress=False)
    rng = random.Random(run_seed)
    one = LLM(model, **OPTS)
    # 7 prompts: under DP attention 4 on one rank and 3 on the other, so the ranks' batches differ
    batch = [[rng.randrange(3, one.engine.vocab_size) for _ in range(rng.randint(20, 200))] for _ in range(7)]
    params = [SamplingParams(temperature=0, max_tokens=4 + 4 * i, ignore_eos=True) for i in range(7)]
    expected = [o.outputs[0].token_ids for o in one.generate(batch, params)]
    del one
    for eager in (False, True):
        llm = within(TIMEOUT_S * 4, lambda: LLM(model, distributed_timeout=TIMEOUT_S, enforce_eager=eager,
                                                **PARALLEL[parallel], **OPTS))
        try:
            c = llm.engine.components
            assert (c.graphs is None) == (c.prefill_graphs is None) == eager
            prefilled = []
            if not eager:  # prompt chunks replay the prefill graphs, their exchanges padded to the bucket
                run = c.prefill_graphs.run
                c.prefill_graphs.run = lambda batch, *a: prefilled.append(batch.num_tokens) or run(batch, *a)
            assert [o.outputs[0].token_ids for o in llm.generate(batch, params)] == expected
            assert bool(prefilled) != eager
        finally:
            llm.engine.shutdown()
