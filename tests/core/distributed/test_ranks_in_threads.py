"""The tensor-parallel forward at 2 and 4 ranks, each rank a thread of this process on one gloo
group (the engine runs them as processes; the model, the weights each rank reads and the
collectives are the same, and threads start in well under a second). Logits of every rank match
one process's over a chunked prefill and decode steps that read the KV cache, for Qwen3 at 4 ranks
(2 KV heads: each rank holds one, shared by two ranks), Llama at 2 (untied LM head, llama3 RoPE),
Qwen3-MoE with split experts and with expert parallelism (all_to_all) at 2 and 4, and
DeepSeek-V4 (tiny-dsv4-py: heads and output groups split, the KV head, compressors and indexer
whole on each rank; hash and routed MoE layers) with split experts and expert parallelism at 2, and
a tiny random DeepSeek-V4.1 the same way (CSA2 sharing, the candidate filter and Engram whole on
each rank)."""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest
import torch

from engine.checkpoints import write_checkpoint
from engine.core.config import EngineConfig, ModelConfig
from engine.core.distributed.group import Rendezvous, join_store, master_store
from engine.core.runner import ModelRunner, StepInputs
from engine.core.startup import build

from dsv41_random import random_v41_checkpoint, v41_config
from tp_helpers import TIMEOUT_S

PAGE_SIZE = 4
DSV41 = dict(ratios=[0, 2, 2, 1, 1, 1], kv_sources=[1, 3], index_sources=[1, 3, 5], candidate=3, blocks=2,
             block_size=2, engram=[0, 4])


def steps(vocab: int) -> list[StepInputs]:
    """Two prompts prefilled in two chunks, then two decode steps, on pages 1.. of each sequence."""
    a, b = torch.randint(0, vocab, (30,)).tolist(), torch.randint(0, vocab, (13,)).tolist()
    tables = np.arange(1, 25, dtype=np.int32).reshape(2, 12)
    out = [StepInputs(a[:16] + b[:7], [16, 7], [0, 0], tables, list(range(23)), [], []),
           StepInputs(a[16:] + b[7:], [14, 6], [16, 7], tables, [13, 19], [], [])]
    for i in range(2):
        out.append(StepInputs(torch.randint(0, vocab, (2,)).tolist(), [1, 1], [30 + i, 13 + i], tables, [0, 1], [], []))
    return out


def run_ranks(config: EngineConfig, size: int, inputs: list[StepInputs]) -> list[list[torch.Tensor]]:
    """Each rank's logits of every step, the ranks run as threads."""
    store = master_store(size, TIMEOUT_S)
    logits: list[list[torch.Tensor]] = [[] for _ in range(size)]
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            st = store if r == 0 else join_store(store.port, size, TIMEOUT_S)
            c = build(config, progress=False, rendezvous=Rendezvous(r, size, st, TIMEOUT_S))
            runner = ModelRunner(c.model, c.kv, None, None, PAGE_SIZE, c.device, None, c.group)
            logits[r] = [runner.run(step) for step in inputs]
            c.group.close()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    if errors:
        raise errors[0]
    return logits


def single(config: EngineConfig, inputs: list[StepInputs]) -> list[torch.Tensor]:
    c = build(config, progress=False)
    runner = ModelRunner(c.model, c.kv, None, None, PAGE_SIZE, c.device)
    return [runner.run(step) for step in inputs]


@pytest.fixture(scope="module")
def models(tmp_path_factory, shared_dir) -> dict:
    out = tmp_path_factory.mktemp("ckpt")
    return {"qwen3": shared_dir / "models" / "tiny-qwen3-py", "dsv4": shared_dir / "models" / "tiny-dsv4-py",
            "llama": write_checkpoint(out / "llama", "tiny-llama", dtype=torch.float32, progress=False),
            "qwen3-moe": write_checkpoint(out / "moe", "tiny-qwen3-moe", dtype=torch.float32, progress=False),
            "dsv41": random_v41_checkpoint(out / "dsv41", 0, v41_config(**DSV41), shared_dir / "models" / "tiny-dsv4-py")}


@pytest.mark.parametrize("which,size,expert_parallel", [
    ("qwen3", 4, False), ("llama", 2, False), ("qwen3-moe", 2, False), ("qwen3-moe", 4, True),
    ("dsv4", 2, False), ("dsv4", 2, True), ("dsv41", 2, False), ("dsv41", 2, True)])
def test_every_rank_computes_the_logits_of_one_process(which, size, expert_parallel, models, seed):
    model = models[which]
    config = EngineConfig(model=str(model), dtype="float32", page_size=PAGE_SIZE, num_pages=32)
    vocab = ModelConfig.from_dir(model).vocab_size
    inputs = steps(vocab)
    expected = single(config, inputs)
    ranks = run_ranks(dataclasses.replace(config, tensor_parallel_size=size, expert_parallel=expert_parallel),
                      size, inputs)
    for got in ranks:
        for g, e, step in zip(got, expected, inputs):
            assert g.shape == e.shape == (len(step.logits_indices), vocab)
            torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)
