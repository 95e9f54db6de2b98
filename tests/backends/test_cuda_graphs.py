"""CUDA graph capture on the GPU: a replay must find every tensor its capture read still there."""

from __future__ import annotations

import gc

import pytest
import torch

pytestmark = pytest.mark.gpu


def test_a_replay_reads_the_tensors_only_the_captured_function_held():
    from engine.backends.cuda.graphs import CudaGraphs

    graphs, static = CudaGraphs(ctx=None), torch.randn(1 << 20, device="cuda")

    def make():
        held = torch.randn(1 << 20, device="cuda")  # referenced by the captured function alone
        return (lambda: static * held), held.clone()

    fn, held_copy = make()
    replay = graphs.capture(fn)
    del fn
    gc.collect()
    torch.cuda.empty_cache()  # a freed block goes back to the driver here, and its address with it
    clobber = [torch.full((1 << 20,), float("nan"), device="cuda") for _ in range(8)]
    static.normal_()
    out = replay()
    torch.testing.assert_close(out, static * held_copy, rtol=0, atol=0)
    del clobber
