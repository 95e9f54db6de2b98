"""The tensor-parallel forward at 2 and 4 ranks, each rank a thread of this process on one gloo
group (the engine runs them as processes; the model, the weights each rank reads and the
collectives are the same, and threads start in well under a second). Logits of every rank match
one process's over a chunked prefill and decode steps that read the KV cache, for Qwen3 at 4 ranks
(2 KV heads: each rank holds one, shared by two ranks), Llama at 2 (untied LM head, llama3 RoPE),
Qwen3-MoE with split experts and with expert parallelism (all_to_all) at 2 and 4, and
DeepSeek-V4 (tiny-dsv4-py: heads and output groups split, the KV head, compressors and indexer
whole on each rank; hash and routed MoE layers) with split experts and expert parallelism at 2, and
a tiny random DeepSeek-V4.1 the same way (CSA2 sharing, the candidate filter and Engram whole on
each rank), and tiny-qwen3-py in the fine-grained FP8 layout at 2 ranks (the o/gate-up/down slices
whole 128-row blocks, kept in E4M3; q/k/v not, 64-row KV slices, dequantized at load). With
expert parallelism the decode steps also run with the padded exchanges a decode graph holds.

Under data-parallel attention each rank runs its own batch (prompts of other lengths on each) and
gets the logits one process computes for that batch, while the MoE layers span the ranks (experts
partitioned, or split with the ranks' tokens gathered); one rank has no batch and runs idle
forwards in step, and a first step where every rank is idle exchanges nothing. With 4 threads in 2
data-parallel ranks each rank's attention is split over its 2 threads, which run its batch together
(each sends half of the rank's tokens to the experts, or to the gather); the decode steps again
with padded exchanges, where every rank decodes 2 sequences."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from engine.checkpoints import write_checkpoint
from engine.checkpoints.fp8_block import write_fp8_block
from engine.core.config import EngineConfig, ModelConfig
from engine.core.distributed.moe import idle_forward, padded_exchanges

from dsv41_random import random_v41_checkpoint, v41_config
from tp_helpers import PAGE_SIZE, run_ranks, single, steps

DSV41 = dict(ratios=[0, 2, 2, 1, 1, 1], kv_sources=[1, 3], index_sources=[1, 3, 5], candidate=3, blocks=2,
             block_size=2, engram=[0, 4])


@pytest.fixture(scope="module")
def models(tmp_path_factory, shared_dir) -> dict:
    out = tmp_path_factory.mktemp("ckpt")
    return {"qwen3": shared_dir / "models" / "tiny-qwen3-py", "dsv4": shared_dir / "models" / "tiny-dsv4-py",
            "llama": write_checkpoint(out / "llama", "tiny-llama", dtype=torch.float32, progress=False),
            "qwen3-moe": write_checkpoint(out / "moe", "tiny-qwen3-moe", dtype=torch.float32, progress=False),
            "dsv41": random_v41_checkpoint(out / "dsv41", 0, v41_config(**DSV41), shared_dir / "models" / "tiny-dsv4-py"),
            "qwen3-fp8": _fp8(shared_dir / "models" / "tiny-qwen3-py", out / "qwen3-fp8")}


def _fp8(src, dst):
    write_fp8_block(src, dst)
    return dst


def decode(runner, step, padded: bool) -> torch.Tensor:
    """The step's logits; with ``padded`` a decode step's MoE exchanges are padded, as in a decode graph."""
    with padded_exchanges() if padded and set(step.query_lens) == {1} else contextlib.nullcontext():
        return runner.run(step)


@pytest.mark.parametrize("which,size,expert_parallel,padded", [
    ("qwen3", 4, False, False), ("llama", 2, False, False), ("qwen3-moe", 2, False, False),
    ("qwen3-moe", 4, True, False), ("qwen3-moe", 2, True, True), ("dsv4", 2, False, False), ("dsv4", 2, True, False),
    ("dsv4", 2, True, True), ("dsv41", 2, False, False), ("dsv41", 2, True, False)])
def test_every_rank_computes_the_logits_of_one_process(which, size, expert_parallel, padded, models, seed):
    model = models[which]
    config = EngineConfig(model=str(model), dtype="float32", page_size=PAGE_SIZE, num_pages=32)
    vocab = ModelConfig.from_dir(model).vocab_size
    inputs = steps(vocab)
    expected = single(config, inputs)
    ranks = run_ranks(dataclasses.replace(config, tensor_parallel_size=size, expert_parallel=expert_parallel),
                      size, lambda r, runner: [decode(runner, step, padded) for step in inputs])
    for got in ranks:
        for g, e, step in zip(got, expected, inputs):
            assert g.shape == e.shape == (len(step.logits_indices), vocab)
            torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)


def test_fp8_ranks_keep_the_slices_that_fill_whole_blocks(models, seed):
    config = EngineConfig(model=str(models["qwen3-fp8"]), dtype="float32", page_size=PAGE_SIZE, num_pages=32)
    inputs = steps(ModelConfig.from_dir(config.model).vocab_size)
    expected = single(config, inputs)

    def body(r, runner):
        schemes = {n.rpartition(".")[2]: m.scheme for n, m in runner.model.named_modules() if n.endswith("_proj")}
        return schemes, [runner.run(step) for step in inputs]

    for schemes, got in run_ranks(dataclasses.replace(config, tensor_parallel_size=2), 2, body):
        assert schemes == {"qkv_proj": "dense", "o_proj": "fp8_block", "gate_up_proj": "fp8_block",
                           "down_proj": "fp8_block"}
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("which,size,dp,expert_parallel,idle,padded", [
    ("dsv4", 2, 2, True, None, False), ("dsv4", 2, 2, True, None, True), ("dsv4", 2, 2, False, 1, False),
    ("dsv4", 4, 4, True, 0, False), ("qwen3-moe", 4, 4, True, 2, False), ("qwen3-moe", 4, 4, False, 3, False),
    ("dsv41", 2, 2, True, 1, False), ("dsv4", 4, 2, True, 1, False), ("qwen3-moe", 4, 2, False, None, False),
    ("qwen3-moe", 4, 2, True, None, True), ("dsv4", 4, 2, False, None, True)])
def test_data_parallel_attention_ranks_compute_their_own_batches(which, size, dp, expert_parallel, idle, padded,
                                                                models, seed):
    """``size`` processes in ``dp`` data-parallel ranks, each rank's attention split over size / dp of them;
    ``padded``: the decode steps (2 sequences on every rank) exchange padded blocks, as in a decode graph."""
    model = models[which]
    config = EngineConfig(model=str(model), dtype="float32", page_size=PAGE_SIZE, num_pages=32)
    vocab = ModelConfig.from_dir(model).vocab_size
    batches = [None if d == idle else steps(vocab, (20 + 7 * d, 8 + 5 * d)) for d in range(dp)]
    expected = [single(config, b) if b is not None else None for b in batches]
    per_rank = size // dp  # processes of a data-parallel rank, which run its batch together

    def rank(r: int, runner) -> list[torch.Tensor] | None:
        idle_forward(runner.model)
        batch = batches[r // per_rank]
        if batch is None:
            for _ in range(4):
                idle_forward(runner.model)
            return None
        return [decode(runner, step, padded) for step in batch]

    ranks = run_ranks(dataclasses.replace(config, tensor_parallel_size=size, data_parallel_size=dp,
                                          enable_dp_attention=True, expert_parallel=expert_parallel), size, rank)
    for r, got in enumerate(ranks):
        want, batch = expected[r // per_rank], batches[r // per_rank]
        assert (got is None) == (batch is None)
        for g, e, step in zip(got or [], want or [], batch or []):
            assert g.shape == e.shape == (len(step.logits_indices), vocab)
            torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)
