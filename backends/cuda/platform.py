"""NVIDIA device detection: compute capability, SMs, memory and what the arch can do.

cuda-python answers when it is installed (it is what the backend's device and IPC helpers use);
torch.cuda answers otherwise. Either import happens only after torch has reported a CUDA device.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch

from engine.core.platform import PlatformSpec

logger = logging.getLogger(__name__)


class DeviceFacts(NamedTuple):
    """What one query of the device returns, whichever library answered it."""

    name: str
    major: int
    minor: int
    sm_count: int
    total_memory: int
    free_memory: int


def arch_name(major: int, minor: int) -> str:
    return f"sm_{major}{minor}"


def capabilities(major: int, minor: int) -> frozenset[str]:
    """Instruction families the kernels choose by.

    FP8 tensor cores arrive with Ada (sm_89); wgmma is Hopper's alone; block-scaled MXFP8 comes
    with Blackwell, and tcgen05 (the tensor memory MMA) only on the datacenter parts (sm_10x,
    sm_110), not on sm_12x, which scale through mma.sync instead.
    """
    caps: set[str] = set()
    if (major, minor) >= (8, 9):
        caps.add("fp8")
    if major == 9:
        caps.add("wgmma")
    if major >= 10:
        caps.add("mxfp8")
    if major in (10, 11):
        caps.add("tcgen05")
    return frozenset(caps)


def _runtime():
    """cuda-python's runtime bindings, or None when cuda-python is not installed."""
    try:
        from cuda.bindings import runtime
    except ImportError:
        try:
            from cuda import cudart as runtime  # cuda-python before 12.6 had no cuda.bindings
        except ImportError:
            return None
    return runtime


def _checked(runtime, result: tuple):
    err, *values = result
    if err != runtime.cudaError_t.cudaSuccess:
        raise RuntimeError(f"CUDA runtime call failed: {err}")
    return values[0] if len(values) == 1 else values


def query_cuda_python(runtime, device: int) -> DeviceFacts:
    _checked(runtime, runtime.cudaSetDevice(device))
    props = _checked(runtime, runtime.cudaGetDeviceProperties(device))
    free, total = _checked(runtime, runtime.cudaMemGetInfo())
    name = props.name.decode(errors="replace") if isinstance(props.name, bytes) else str(props.name)
    return DeviceFacts(name.rstrip("\x00").strip(), int(props.major), int(props.minor),
                       int(props.multiProcessorCount), int(total), int(free))


def query_torch(device: int) -> DeviceFacts:
    props = torch.cuda.get_device_properties(device)
    free, total = torch.cuda.mem_get_info(device)
    return DeviceFacts(props.name, props.major, props.minor, props.multi_processor_count, total, free)


def spec_from(facts: DeviceFacts) -> PlatformSpec:
    return PlatformSpec(
        vendor="nvidia",
        arch=arch_name(facts.major, facts.minor),
        device_name=facts.name,
        torch_device="cuda",
        total_memory=facts.total_memory,
        free_memory=facts.free_memory,
        compute_units=facts.sm_count,
        capabilities=capabilities(facts.major, facts.minor),
    )


def detect() -> PlatformSpec | None:
    """The current CUDA device, or None unless torch is a CUDA build that sees one."""
    if not torch.version.cuda or not torch.cuda.is_available():
        return None
    device = torch.cuda.current_device()
    runtime = _runtime()
    if runtime is None:
        return spec_from(query_torch(device))
    try:
        return spec_from(query_cuda_python(runtime, device))
    except RuntimeError as exc:  # a cuda-python that cannot talk to this driver; torch can
        logger.warning("cuda-python device query failed (%s); using torch.cuda", exc)
        return spec_from(query_torch(device))
