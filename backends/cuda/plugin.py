"""The NVIDIA backend as a plugin, registered through ``engine.plugins`` like any third party.

It claims the machine when torch sees a CUDA device. Importing this module imports no vendor
library: cuda-python is imported inside detection, and only where torch has found a device.
"""

from __future__ import annotations

from engine.core.hookspecs import hookimpl
from engine.core.platform import PlatformSpec
from engine.core.registry import Descriptor

from ..triton.descriptors import triton_descriptors
from . import platform


@hookimpl
def engine_detect_platform() -> PlatformSpec | None:
    return platform.detect()


@hookimpl
def engine_register_attention_backends() -> list[Descriptor]:
    return triton_descriptors("attention", "nvidia")


@hookimpl
def engine_register_v4_attention_backends() -> list[Descriptor]:
    return triton_descriptors("v4_attention", "nvidia")


@hookimpl
def engine_register_moe_backends() -> list[Descriptor]:
    return triton_descriptors("moe", "nvidia")


@hookimpl
def engine_register_linear_backends() -> list[Descriptor]:
    return triton_descriptors("linear", "nvidia")


@hookimpl
def engine_register_norm_backends() -> list[Descriptor]:
    return triton_descriptors("norm", "nvidia")


@hookimpl
def engine_register_sampling_backends() -> list[Descriptor]:
    return triton_descriptors("sampling", "nvidia")


@hookimpl
def engine_register_mhc_backends() -> list[Descriptor]:
    return triton_descriptors("mhc", "nvidia")


@hookimpl
def engine_register_graph_backends() -> list[Descriptor]:
    return [Descriptor("graphs", "cuda_graphs", _create_graphs, priority=100, check=_graph_reasons)]


def _graph_reasons(ctx) -> list[str]:
    return [] if ctx.platform.vendor == "nvidia" else [f"needs an NVIDIA GPU (the platform is {ctx.platform.summary()})"]


def _create_graphs(ctx):
    from .graphs import CudaGraphs

    return CudaGraphs(ctx)


@hookimpl
def engine_register_kv_transports() -> list[Descriptor]:
    return [Descriptor("kv_transport", "cuda_ipc", _create_ipc, check=_ipc_reasons)]


def _ipc_reasons(ctx) -> list[str]:
    from .kv_ipc import ipc_reasons

    return ipc_reasons(ctx)


def _create_ipc(ctx):
    from .kv_ipc import CudaIpcTransport

    return CudaIpcTransport(ctx)
