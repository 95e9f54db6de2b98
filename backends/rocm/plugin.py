"""The AMD backend as a plugin, registered through ``engine.plugins`` like any third party.

It claims the machine when a ROCm build of torch sees a device. Importing this module imports no
vendor library: hip-python is imported inside detection, and only where torch has found a device.
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
    return triton_descriptors("attention", "amd")


@hookimpl
def engine_register_v4_attention_backends() -> list[Descriptor]:
    return triton_descriptors("v4_attention", "amd")


@hookimpl
def engine_register_moe_backends() -> list[Descriptor]:
    return triton_descriptors("moe", "amd")


@hookimpl
def engine_register_linear_backends() -> list[Descriptor]:
    return triton_descriptors("linear", "amd")


@hookimpl
def engine_register_norm_backends() -> list[Descriptor]:
    return triton_descriptors("norm", "amd")


@hookimpl
def engine_register_sampling_backends() -> list[Descriptor]:
    return triton_descriptors("sampling", "amd")


@hookimpl
def engine_register_mhc_backends() -> list[Descriptor]:
    return triton_descriptors("mhc", "amd")


@hookimpl
def engine_register_graph_backends() -> list[Descriptor]:
    return [Descriptor("graphs", "hip_graphs", _create_graphs, priority=100, check=_graph_reasons)]


def _graph_reasons(ctx) -> list[str]:
    from .graphs import graph_reasons

    return graph_reasons(ctx)


def _create_graphs(ctx):
    from .graphs import HipGraphs

    return HipGraphs(ctx)
