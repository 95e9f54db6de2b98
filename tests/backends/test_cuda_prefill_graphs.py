"""Breakable prefill graphs on a GPU: CUDA graph segments around eager breaks, and whole engines
(graphs on, as `engine serve` runs with no flags) against eager ones (--enforce-eager) on
tiny-qwen3-py and tiny-dsv4-py, over chunked prefill and prefix hits.

Run: pytest -m gpu tests/backends/test_cuda_prefill_graphs.py
"""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from greedy_agreement import GreedyAgreement, compare_requests

pytestmark = pytest.mark.gpu

TOP = 5


def test_segments_replay_around_an_eager_break():
    """A carried buffer holds the break's result in the recording and whatever a replay's break
    writes through its unowned view; the segment's intermediates need no owner after recording."""
    from engine.backends.cuda.graphs import CudaGraphs

    graphs = CudaGraphs(ctx=None)
    x, w = torch.randn(64, 32, device="cuda"), torch.randn(32, 16, device="cuda")

    def eager(h: torch.Tensor) -> torch.Tensor:  # the break: run outside the graphs, between their replays
        return h[:, : h.shape[1] // 2].softmax(-1)

    want = torch.relu(x @ w)  # before any capture: cuBLAS makes its handle on first use, which a capture refuses
    graphs.begin_segment()
    h = torch.relu(x @ w)
    first = graphs.end_segment()
    torch.testing.assert_close(h, want)  # it ran once at the end of its capture
    o = eager(h)
    graphs.begin_segment()
    carried = graphs.carry(o)
    y = carried * 2 + 1
    second = graphs.end_segment()
    torch.testing.assert_close(y, eager(torch.relu(x @ w)) * 2 + 1)
    h_view, carried_view = graphs.unowned(h), graphs.unowned(carried)
    del h, carried
    for _ in range(3):
        x.normal_()
        first()
        carried_view.copy_(eager(h_view))
        second()
        torch.testing.assert_close(y, eager(torch.relu(x @ w)) * 2 + 1)


def _prompts(seed: int, vocab: int) -> list[list[list[int]]]:
    """Two rounds: prompts of 1 to 300 tokens, then prompts sharing a prefix of one of them."""
    rng = random.Random(seed)
    first = [[rng.randrange(10, vocab) for _ in range(rng.randint(1, 300))] for _ in range(5)]
    second = [p[:rng.randint(1, len(p))] + [rng.randrange(10, vocab) for _ in range(rng.randint(1, 60))]
              for p in rng.sample(first, 3)]
    return [first, second]


def _compare(model: str, dtype: str, seed: int, bound: float, fraction: float, monkeypatch) -> LLM:
    kw = dict(device="cuda", dtype=dtype, max_model_len=1024, max_num_batched_tokens=512, chunked_prefill_size=96,
              progress=False)
    graphed, eager = LLM(model, **kw), LLM(model, **kw, enforce_eager=True)
    graphs = graphed.engine.runner.prefill_graphs
    assert graphs is not None and graphs.buckets[-1] == 512
    assert eager.engine.runner.prefill_graphs is None and eager.engine.runner.graphs is None
    runs = []
    real = graphs.run
    monkeypatch.setattr(graphs, "run", lambda batch, *a: runs.append(batch.num_tokens) or real(batch, *a))
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=TOP, prompt_logprobs=0)
    agreement, worst = GreedyAgreement(), 0.0
    for prompts in _prompts(seed, graphed.engine.vocab_size):
        step, gap = compare_requests(graphed.generate(prompts, params), eager.generate(prompts, params), bound=bound)
        agreement, worst = agreement + step, max(worst, gap)
    assert worst < bound, worst
    agreement.assert_most_sure(fraction)
    assert runs and max(runs) > 96, runs  # chunks beside decodes, several to a step
    return graphed


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_qwen3_prefill_through_graphs_equals_eager(tiny_qwen3, dtype, seed, monkeypatch):
    # a bucket's GEMMs run more rows than the eager step's, which cuBLAS may split otherwise: the
    # bounds of test_cuda_engine's decode graphs against eager
    graphed = _compare(str(tiny_qwen3), dtype, seed, 5e-3 if dtype == "float32" else 5e-2,
                       0.5 if dtype == "float32" else 0.1, monkeypatch)
    breaks = graphed.engine.runner.prefill_graphs.recorder(16).breaks
    assert {b.call.__name__ for b in breaks} == {"rope_forward"}


def test_dsv4_prefill_through_graphs_equals_eager(shared_dir, seed, monkeypatch):
    """Its window store, compressors, indexer and attention in the breaks; the Triton MoE, mHC and
    projections in the segments."""
    graphed = _compare(str(shared_dir / "models" / "tiny-dsv4-py"), "bfloat16", seed, 0.15, 0.05, monkeypatch)
    calls = [b.call.__name__ for b in graphed.engine.runner.prefill_graphs.recorder(16).breaks]
    assert calls[0] == "prepare" and {"store", "compress", "select", "attend"} <= set(calls)
    assert not {"experts", "route", "route_experts"} & set(calls)
