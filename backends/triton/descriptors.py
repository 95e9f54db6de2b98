"""Descriptors for the shared Triton kernels, offered by the CUDA and the ROCm plugins alike.

Each plugin passes its vendor; a descriptor refuses (with the reason) on another vendor's device,
where triton is missing, or where the model needs what the kernels lack, and otherwise outranks
the native oracle, which stays selectable by name (``--attention-backend native``).
"""

from __future__ import annotations

from importlib import import_module
from importlib.util import find_spec

from engine.core.registry import Descriptor, SelectionContext

TRITON_PRIORITY = 100
PLATFORM_NAMES = {"nvidia": "an NVIDIA GPU", "amd": "an AMD GPU"}
MHC_MAX_STREAMS = 16  # backends/triton/mhc.py holds a token's n x n comb in one program's registers


def _platform_reasons(ctx: SelectionContext, vendor: str) -> list[str]:
    reasons = []
    if ctx.platform.vendor != vendor:
        reasons.append(f"needs {PLATFORM_NAMES[vendor]} (the platform is {ctx.platform.summary()})")
    if find_spec("triton") is None:
        reasons.append("triton is not installed (pip install engine[cuda] or engine[rocm])")
    return reasons


def _mhc_reasons(ctx: SelectionContext) -> list[str]:
    n = ctx.model_config.hf.get("hc_mult", 4) if ctx.model_config is not None else 0
    return [f"hc_mult {n}: the kernels take at most {MHC_MAX_STREAMS} streams"] if n > MHC_MAX_STREAMS else []


def _v4_attention_reasons(ctx: SelectionContext) -> list[str]:
    if ctx.model_config is None or find_spec("triton") is None:  # no triton: the platform's reason says so
        return []
    from .v4_sparse_attention import SPARSE

    hf = ctx.model_config.hf
    reasons = []
    head_dim = hf.get("head_dim")
    configured = {d for tuning in (SPARSE["cuda"], SPARSE["hip"]) for d in tuning.per_dim}
    if head_dim not in configured:
        reasons.append(f"the V4 sparse attention kernel has no config for head dim {head_dim} "
                       f"(configured: {sorted(configured)})")
    return reasons


def _no_model_reasons(ctx: SelectionContext) -> list[str]:
    return []


# what a family's kernels lack for a model, beside the platform
MODEL_REASONS = {"mhc": _mhc_reasons, "v4_attention": _v4_attention_reasons}


def _create(path: str):
    module, _, name = path.partition(":")
    return lambda ctx: getattr(import_module(module), name)(ctx)


def triton_descriptors(family: str, vendor: str) -> list[Descriptor]:
    impl = {"attention": "engine.backends.triton.attention:TritonAttention",
            "v4_attention": "engine.backends.triton.v4_attention:TritonV4Attention",
            "moe": "engine.backends.triton.moe:TritonMoE",
            "linear": "engine.backends.triton.linear:TritonLinear",
            "norm": "engine.backends.triton.norm:TritonNorm",
            "sampling": "engine.backends.triton.sampling:TritonSampling",
            "mhc": "engine.backends.triton.mhc:TritonMHC"}[family]
    model_reasons = MODEL_REASONS.get(family, _no_model_reasons)
    return [Descriptor(family, "triton", _create(impl), priority=TRITON_PRIORITY,
                       check=lambda ctx: _platform_reasons(ctx, vendor) + model_reasons(ctx))]
