"""CUDA graphs: each decode bucket captured once at start-up, replayed every step after; prefill
buckets captured as segments around eager breaks (core/prefill_graphs.py).

All captures share one memory pool, largest first, so the smaller graphs fit inside the memory
the largest one already took. Warm-up runs on a side stream first, as PyTorch requires, so lazily
built state (Triton's compiled kernels, cuBLAS workspaces) exists before capture. Segments are
captured on that side stream too; each runs once right after its capture (on the current
stream, where the eager breaks run), so the break after it computes on real values. A tensor the
recorder keeps of a segment's (``unowned``) does not hold its memory: the pool hands it to what
the recording allocates later, as vLLM's piecewise graphs keep weak references to theirs.
Only torch's CUDA-named API is used, which a ROCm build of torch serves with HIP graphs: the AMD
plugin runs this class as its ``hip_graphs`` (backends/rocm/graphs.py).
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch

from engine.core.families.graphs import GraphBackend

WARMUP_RUNS = 2


class _Memory:
    """Bytes on the device, offered to ``torch.as_tensor`` without an owner (CUDA array interface)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3}


class CudaGraphs(GraphBackend):
    name = "cuda_graphs"
    breakable = True

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self._pool = torch.cuda.graph_pool_handle()
        # each graph with the function it captured: a replay reads and writes the addresses the
        # capture saw, so every tensor the function holds (a batch's metadata too) must outlive it
        self._graphs: list[tuple[torch.cuda.CUDAGraph, Callable[[], torch.Tensor] | None]] = []
        self._side = torch.cuda.Stream()  # where warm-ups run and segments are captured
        self._segment: torch.cuda.CUDAGraph | None = None
        self._origin: torch.cuda.Stream | None = None  # the stream a segment's capture returns to
        self._fills: list[tuple[torch.Tensor, torch.Tensor]] = []  # (carried buffer, its value) of the open segment

    def capture(self, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        self.warm_up(fn)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = fn()
        self._graphs.append((graph, fn))

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay

    def warm_up(self, fn: Callable[[], object]) -> None:
        self._side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._side):
            for _ in range(WARMUP_RUNS):
                fn()
        torch.cuda.current_stream().wait_stream(self._side)

    def memory_in_use(self) -> int:
        free, total = torch.cuda.mem_get_info()
        return total - free

    def begin_segment(self) -> None:
        self._side.wait_stream(torch.cuda.current_stream())
        self._segment, self._origin = torch.cuda.CUDAGraph(), torch.cuda.current_stream()
        torch.cuda.set_stream(self._side)
        try:
            self._segment.capture_begin(pool=self._pool)
        except BaseException:
            torch.cuda.set_stream(self._origin)
            raise

    def end_segment(self) -> Callable[[], None]:
        graph, fills, self._segment, self._fills = self._segment, self._fills, None, []
        try:
            with warnings.catch_warnings():  # two breaks in a row leave a segment with no work: fine
                warnings.filterwarnings("ignore", message="The CUDA Graph is empty")
                graph.capture_end()
        finally:
            torch.cuda.set_stream(self._origin)
        for buffer, value in fills:
            buffer.copy_(value)
        graph.replay()
        self._graphs.append((graph, None))
        return graph.replay

    def carry(self, value: torch.Tensor) -> torch.Tensor:
        buffer = torch.empty_like(value)  # in the pool: the segment is capturing
        self._fills.append((self.unowned(buffer), value))
        return buffer

    def unowned(self, t: torch.Tensor) -> torch.Tensor:
        if t.numel() == 0:
            return t
        span = (sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1) * t.element_size()
        raw = torch.as_tensor(_Memory(t.data_ptr(), span), device=t.device)
        return raw.view(t.dtype).as_strided(t.shape, t.stride())
