"""HIP graphs: the graphs backend on AMD GPUs, where torch's ROCm build offers them.

A ROCm build of torch captures and replays HIP graphs through the very API CUDA graphs use
(``torch.cuda.CUDAGraph``, ``torch.cuda.graph``, ``graph_pool_handle``, streams), so the AMD
backend runs CudaGraphs' code unchanged: decode buckets captured largest first in one pool, and
prefill steps recorded as segments around eager breaks. Only the name and the refusals are its own.
Programmatic dependent launch stays off here (backends/triton/pdl.py asks for CUDA sm_90).
"""

from __future__ import annotations

import torch

from ..cuda.graphs import CudaGraphs

# torch's graph_pool_handle (and so every capture into a shared pool) raises on ROCm before 5.3
HIP_GRAPHS_SINCE = (5, 3)


class HipGraphs(CudaGraphs):
    name = "hip_graphs"


def rocm_version(hip: str) -> tuple[int, ...]:
    """``"6.3.42131-fa1d09cbd"`` -> ``(6, 3)``: the release torch was built against."""
    return tuple(int(part) for part in hip.split("-", 1)[0].split(".")[:2])


def graph_reasons(ctx) -> list[str]:
    """Why HIP graphs cannot capture here: not an AMD platform, or a torch that has none."""
    if ctx.platform.vendor != "amd":
        return [f"needs an AMD GPU (the platform is {ctx.platform.summary()})"]
    hip = torch.version.hip
    if not hip:
        return [f"needs a ROCm build of torch for HIP graphs (this is torch {torch.__version__})"]
    if rocm_version(hip) < HIP_GRAPHS_SINCE:
        since = ".".join(map(str, HIP_GRAPHS_SINCE))
        return [f"torch's HIP graphs need ROCm {since} or later (this torch is built for ROCm {hip})"]
    return []
