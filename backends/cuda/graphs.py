"""CUDA graphs: each decode bucket captured once at start-up, replayed every step after.

All captures share one memory pool, largest batch first, so the smaller graphs fit inside the
memory the largest one already took. Warm-up runs on a side stream first, as PyTorch requires,
so lazily built state (Triton's compiled kernels, cuBLAS workspaces) exists before capture.
"""

from __future__ import annotations

from typing import Callable

import torch

from engine.core.families.graphs import GraphBackend

WARMUP_RUNS = 2


class CudaGraphs(GraphBackend):
    name = "cuda_graphs"

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self._pool = torch.cuda.graph_pool_handle()
        # each graph with the function it captured: a replay reads and writes the addresses the
        # capture saw, so every tensor the function holds (a batch's metadata too) must outlive it
        self._graphs: list[tuple[torch.cuda.CUDAGraph, Callable[[], torch.Tensor]]] = []

    def capture(self, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = fn()
        self._graphs.append((graph, fn))

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay

    def memory_in_use(self) -> int:
        free, total = torch.cuda.mem_get_info()
        return total - free
