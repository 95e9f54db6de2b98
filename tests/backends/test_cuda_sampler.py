"""The sampler on a GPU queues its work behind the step and never waits for the device: one
synchronising call (a tensor built from a host list, an ``.item()``) would undo overlapped decode."""

from __future__ import annotations

import random

import pytest
import torch

from engine.core.registry import import_path
from engine.core.sampler import Sampler
from engine.core.sampling_params import SamplingParams
from engine.core.sequence import Sequence
from engine.core.token_table import TokenTable

pytestmark = pytest.mark.gpu

V = 1000


def _rows(table: TokenTable) -> list[Sequence]:
    """Every option the sampler applies, seeded and shared generators, tokens in flight."""
    options = [dict(temperature=0), dict(temperature=0, logprobs=3), dict(temperature=0.8, top_p=0.9),
               dict(temperature=1.2, top_k=20, min_p=0.05, seed=7), dict(temperature=0.7, logit_bias={5: 2.0}),
               dict(temperature=0.9, repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.1),
               dict(temperature=0, min_tokens=4, stop_token_ids=[9], logprobs=1)]
    rows = []
    for opts in options:
        gen = torch.Generator("cuda").manual_seed(opts["seed"]) if "seed" in opts else None
        row = Sequence(0, "r", 0, [random.randrange(V) for _ in range(5)], SamplingParams(**opts), gen,
                       [random.randrange(V) for _ in range(2)], slot=table.assign(), num_pending=1)
        rows.append(row)
    return rows


# imported in the test: a Triton kernel module imported at collection, before tests/backends/triton's
# conftest sets TRITON_INTERPRET on a CPU machine, would be compiled for a GPU in every later test
@pytest.mark.parametrize("backend", ["engine.core.native.sampling:NativeSampling",
                                     "engine.backends.triton.sampling:TritonSampling"])
def test_sampling_never_synchronises(seed, backend):
    table = TokenTable(8, "cuda")
    sampler = Sampler(V, {1}, table, import_path(backend)(None), seed=seed)
    rows = _rows(table)
    logits = torch.randn(len(rows), V, device="cuda") * 3
    sampler(logits, rows)  # first use: allocations and kernels loaded outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            out = sampler(logits, rows)
            sampler(logits[:1], rows[:1])  # the plain greedy path
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(out.token_ids) == len(rows) and all(0 <= t < V for t in out.token_ids)
    assert out.token_ids[0] == logits[0].argmax().item()
