"""The Triton V4 attention and mHC backends offered on the CPU, where their kernels run in the
interpreter. Their real descriptors refuse a CPU; this test plugin offers the same backends under
the same names, so ``v4_attention_backend="triton"`` and ``mhc_backend="triton"`` select them as
the CUDA and ROCm plugins' descriptors would on their devices."""

from __future__ import annotations

import types

from engine.core.hookspecs import hookimpl
from engine.core.registry import Descriptor


def interpreted_triton() -> types.ModuleType:
    from engine.backends.triton.mhc import TritonMHC
    from engine.backends.triton.v4_attention import TritonV4Attention

    module = types.ModuleType("interpreted_triton_v4")

    @hookimpl
    def engine_register_v4_attention_backends():
        return [Descriptor("v4_attention", "triton", TritonV4Attention)]

    @hookimpl
    def engine_register_mhc_backends():
        return [Descriptor("mhc", "triton", TritonMHC)]

    module.engine_register_v4_attention_backends = engine_register_v4_attention_backends
    module.engine_register_mhc_backends = engine_register_mhc_backends
    return module
