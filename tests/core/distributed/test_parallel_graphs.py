"""Prefill and verify graphs under expert parallelism and data-parallel attention, the ranks threads
of this process on one gloo group: every rank's logits are one process's (eager) within 1e-4.

Prefill graphs on the recorded graphs backend (core/native/graphs.py: the segments' torch
operations and collectives replayed), the MoE exchanges inside them padded to the bucket and the
native MoE's expert calls breaks inside the exchange, over a chunked prefill and decode steps:
expert parallel over 2 ranks (tiny-dsv4-py, tiny Qwen3-MoE), and data-parallel attention (experts
partitioned, or split with the ranks' tokens gathered) where the ranks' steps fall in different
buckets, so each replays the bucket of the larger, and one rank, idle, replays the placeholder
batch of the others' bucket; and 2 data-parallel ranks of 2 processes each (attention split). Verify graphs (K+1 tokens a sequence) under data-parallel attention,
captured with a replay that re-runs the captured function in its capture's context: the ranks agree
on a verify bucket, a rank with fewer sequences or none pads, and where one rank verifies and the
other decodes no graph holds both and both run eagerly. The agreement itself, over the three kinds
of graph: tests/core/distributed/test_padded_dispatch.py."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from engine.checkpoints import write_checkpoint
from engine.core.config import EngineConfig, ModelConfig
from engine.core.graph_runner import DecodeGraphs
from engine.core.runner import ModelRunner, StepInputs

from tp_helpers import PAGE_SIZE, ReplayInCaptureContext, run_ranks, single, steps

K = 3  # drafts a verify step checks


@pytest.fixture(scope="module")
def models(tmp_path_factory, shared_dir) -> dict:
    out = tmp_path_factory.mktemp("ckpt")
    return {"dsv4": shared_dir / "models" / "tiny-dsv4-py",
            "qwen3-moe": write_checkpoint(out / "moe", "tiny-qwen3-moe", dtype=torch.float32, progress=False)}


def config_of(model) -> EngineConfig:
    return EngineConfig(model=str(model), dtype="float32", page_size=PAGE_SIZE, num_pages=32)


def spied(graphs, calls: list) -> None:
    """Each replay of ``graphs`` (its tokens and bucket) and each padding replay ("pad", bucket) into ``calls``."""
    run, pad = graphs.run, graphs.pad
    graphs.run = lambda batch, bucket=None: calls.append((batch.num_tokens, bucket)) or run(batch, bucket)
    graphs.pad = lambda bucket: calls.append(("pad", bucket)) or pad(bucket)


@pytest.mark.parametrize("which", ["dsv4", "qwen3-moe"])
def test_expert_parallel_prefill_replays_graphs_with_the_exchange_inside(which, models, seed):
    model = models[which]
    config = config_of(model)
    inputs = steps(ModelConfig.from_dir(model).vocab_size)
    expected = single(config, inputs)

    def rank(r, runner):
        graphs, calls = runner.prefill_graphs, []
        assert graphs is not None and graphs.buckets == [16, 32]
        spied(graphs, calls)
        return [runner.run(step) for step in inputs], calls

    parallel = dataclasses.replace(config, tensor_parallel_size=2, expert_parallel=True, graph_backend="recorded",
                                   max_prefill_graph_tokens=32)
    for got, calls in run_ranks(parallel, 2, rank):
        assert [n for n, _ in calls] == [len(s.input_ids) for s in inputs]  # every step through a prefill graph
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("which,size,expert_parallel", [("dsv4", 2, True), ("qwen3-moe", 2, True),
                                                       ("qwen3-moe", 2, False), ("qwen3-moe", 4, True)])
def test_data_parallel_ranks_agree_on_the_prefill_bucket(which, size, expert_parallel, models, seed):
    """2 data-parallel ranks, of one process each or of 2 (attention split, each sending half its
    rank's tokens to the experts): rank 0's second chunk (5 tokens) replays bucket 32, which rank 1's
    (17 tokens) needs; then rank 1 idles through rank 0's second batch, replaying the placeholder
    batch of each step's bucket."""
    model = models[which]
    config = config_of(model)
    vocab = ModelConfig.from_dir(model).vocab_size
    batches = [steps(vocab, (20, 8)), steps(vocab, (27, 13))]
    expected = [single(config, b) for b in batches]
    alone = steps(vocab, (19, 10))  # rank 0's alone, rank 1 idle
    expected_alone = single(config, alone)
    per_rank = size // 2  # processes of a data-parallel rank, which run its steps together

    def rank(r, runner):
        d, graphs, calls = r // per_rank, runner.prefill_graphs, []
        spied(graphs, calls)
        runner.idle()  # a step where every rank is idle: nothing replayed
        got = [runner.run(step) for step in batches[d]]
        if d == 0:
            got += [runner.run(step) for step in alone]
        else:
            for _ in alone:
                runner.idle()
        return got, calls

    parallel = dataclasses.replace(config, tensor_parallel_size=size, data_parallel_size=2, enable_dp_attention=True,
                                   expert_parallel=expert_parallel, graph_backend="recorded",
                                   max_prefill_graph_tokens=32)
    for r, (got, calls) in enumerate(run_ranks(parallel, size, rank)):
        if r // per_rank == 0:
            # the second chunks (5 and 17 tokens): both ranks through bucket 32
            assert calls[:4] == [(23, 32), (5, 32), (2, 16), (2, 16)]
            assert [n for n, _ in calls[4:]] == [len(s.input_ids) for s in alone]
            want = expected[0] + expected_alone
        else:
            assert calls == [(23, 32), (17, 32), (2, 16), (2, 16), ("pad", 32), ("pad", 16), ("pad", 16), ("pad", 16)]
            want = expected[1]
        assert len(got) == len(want)
        for g, e in zip(got, want):
            torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)


def _verify_steps(vocab: int, lengths: list[int], kinds: list[str | None], gen: torch.Generator) -> list:
    """One rank's steps: its prompts of ``lengths`` prefilled in one step, then per entry of ``kinds``
    a step of every sequence: "verify" (K+1 tokens each, every row's logits), "decode" (one), None
    (the rank idles)."""
    tables = np.arange(1, 1 + 12 * len(lengths), dtype=np.int32).reshape(len(lengths), 12)
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]
    out = [StepInputs(sum(prompts, []), list(lengths), [0] * len(lengths), tables,
                      list(np.cumsum(lengths) - 1), [], [])]
    ctx = list(lengths)
    for kind in kinds:
        if kind is None:
            out.append(None)
            continue
        q = K + 1 if kind == "verify" else 1
        t = q * len(ctx)
        out.append(StepInputs(torch.randint(0, vocab, (t,), generator=gen).tolist(), [q] * len(ctx), list(ctx),
                              tables, list(range(t)), [], []))
        ctx = [c + q for c in ctx]
    return out


def test_data_parallel_ranks_agree_on_the_verify_bucket(models, seed):
    """Qwen3-MoE (native attention reads the lengths on the device, as a graph needs), DP2 with the
    experts partitioned: rank 0 verifies 2 sequences while rank 1 verifies 1 (bucket 2 for both),
    then idles (padding bucket 2), then both decode (decode bucket 2), then one verifies while the
    other decodes: eager on both."""
    model = models["qwen3-moe"]
    config = config_of(model)
    vocab = ModelConfig.from_dir(model).vocab_size
    gen = torch.Generator().manual_seed(seed)
    script = [_verify_steps(vocab, [9, 14], ["verify", "verify", "decode", "verify"], gen),
              _verify_steps(vocab, [11], ["verify", None, "decode", "decode"], gen)]
    expected = [single(config, [s for s in steps_ if s is not None]) for steps_ in script]

    def rank(r, runner):
        decode, verify = (DecodeGraphs(runner.model, runner.kv, ReplayInCaptureContext(None), PAGE_SIZE, 64, 4,
                                       runner.device, q) for q in (1, K + 1))
        decode.capture(progress=False)
        verify.capture(progress=False)
        calls = []
        for graphs, kind in ((decode, "decode"), (verify, "verify")):
            run, pad = graphs.run, graphs.pad
            graphs.run = lambda *a, kind=kind, run=run: calls.append((kind, a[4])) or run(*a)
            graphs.pad = lambda b, kind=kind, pad=pad: calls.append((kind, "pad", b)) or pad(b)
        graphed = ModelRunner(runner.model, runner.kv, None, None, PAGE_SIZE, runner.device, decode, runner.group,
                              verify_graphs=verify, agree=runner.choice.agree)
        got = []
        for step in script[r]:
            if step is None:
                graphed.idle()
            else:
                got.append(graphed.run(step))
        return got, calls

    parallel = dataclasses.replace(config, tensor_parallel_size=2, data_parallel_size=2, enable_dp_attention=True,
                                   expert_parallel=True)
    (got0, calls0), (got1, calls1) = run_ranks(parallel, 2, rank)
    assert calls0 == [("verify", 2), ("verify", 2), ("decode", 2)]
    assert calls1 == [("verify", 2), ("verify", "pad", 2), ("decode", 2)]
    for got, want in ((got0, expected[0]), (got1, expected[1])):
        assert len(got) == len(want)
        for g, e in zip(got, want):
            torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)
