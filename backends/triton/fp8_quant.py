"""Per-token-group FP8 activation quantization: the activation side of the DeepSeek-V3 FP8 GEMM.

Each token's K channels are cut into groups of 128; a group's scale is amax / 448 in fp32 (1 for
an all-zero group) and its data is x / scale clamped to +-448 in E4M3, bit for bit what
``core.native.quant.quantize_fp8_token_group`` computes. Divisions are correctly rounded
(``div_rn``) because the fast fp32 division of the GPU can differ from torch's in the last bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .pdl import launch_options, wait_for_prior
from .target import config_for

FP8_MAX = tl.constexpr(448.0)
GROUP = 128


@triton.jit
def e4m3_rne(y):
    """fp32 ``y`` in [-448, 448] to E4M3, rounded to nearest even, built bit by bit.

    No float-to-fp8 conversion runs at all: the E4M3 bits are assembled from y's fp32 bits and
    bitcast, so every target gives torch's result whatever its conversion instruction does (the
    interpreter's rounds ties up and loses the carry into the exponent). Normals keep 3 mantissa
    bits (add half an ulp, plus one for a tie to even, and truncate); below 2**-6 (subnormals, a
    fixed step of 2**-9) adding and removing 2**14, whose fp32 ulp is 2**-9, rounds to that step.
    """
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    rounded = (bits + 0x7FFFF + ((bits >> 20) & 1)) & 0x7FF00000  # exponent and 3 mantissa bits
    normal = (rounded >> 20) - (120 << 3)  # rebias the exponent from 127 to 7
    subnormal = (((tl.abs(y) + 16384.0) - 16384.0) * 512.0).to(tl.int32)  # 0..8 steps of 2**-9
    magnitude = tl.where((bits & 0x7FFFFFFF) >= 0x3C800000, normal, subnormal)
    return (sign | magnitude).to(tl.uint8).to(tl.float8e4nv, bitcast=True)


@triton.jit
def e8m0_to_float(e):
    """Biased E8M0 exponents (int32, 0..254) -> 2**(e - 127) in fp32; 0 is the subnormal 2**-127."""
    return tl.where(e == 0, 0x00400000, e << 23).to(tl.float32, bitcast=True)


@triton.jit
def _token_group_quant_kernel(x_ptr, data_ptr, scale_ptr, norm_ptr, T, K, stride_x, stride_data, stride_scale, eps,
                              BLOCK_T: tl.constexpr, GROUP_K: tl.constexpr, PDL: tl.constexpr,
                              NORM: tl.constexpr = False, ROUND_BEFORE_WEIGHT: tl.constexpr = False):
    """One program: BLOCK_T tokens x one group of GROUP_K channels. With NORM the group is first
    RMS-normalised by its whole row (read here, a few KB from L1/L2) and the weight at ``norm_ptr``,
    rounded to x's dtype as backends/triton/norm.py rounds it, so the norm costs no launch."""
    wait_for_prior(PDL)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    group = tl.program_id(1)
    cols = group * GROUP_K + tl.arange(0, GROUP_K)
    mask = (rows[:, None] < T) & (cols[None, :] < K)
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_x
    x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0)
    if NORM:
        ss = tl.zeros([BLOCK_T], tl.float32)
        for k0 in range(0, K, GROUP_K):
            c = k0 + tl.arange(0, GROUP_K)
            xs = tl.load(x_rows + c[None, :], mask=(rows[:, None] < T) & (c[None, :] < K), other=0.0).to(tl.float32)
            ss += tl.sum(xs * xs, axis=1)
        h = x.to(tl.float32) * tl.rsqrt(ss / K + eps)[:, None]
        if ROUND_BEFORE_WEIGHT:
            h = h.to(x.dtype).to(tl.float32)
        x = (tl.load(norm_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)[None, :] * h).to(x.dtype)
    data, scale = token_groups(x.to(tl.float32))
    tl.store(data_ptr + rows[:, None].to(tl.int64) * stride_data + cols[None, :], data, mask=mask)
    tl.store(scale_ptr + rows.to(tl.int64) * stride_scale + group, scale, mask=rows < T)


@triton.jit
def token_groups(x):
    """fp32 groups [R, G] (channels past K as 0) -> (E4M3 [R, G], fp32 scales [R])."""
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.where(amax > 0, tl.math.div_rn(amax, FP8_MAX), 1.0)
    y = tl.minimum(tl.maximum(tl.math.div_rn(x, scale[:, None]), -FP8_MAX), FP8_MAX)
    return e4m3_rne(y), scale


@dataclass(frozen=True)
class QuantConfig:
    block_t: int  # tokens per program
    num_warps: int


QUANT = {
    "cuda": QuantConfig(8, 4),
    "hip": QuantConfig(8, 4),
    "default": QuantConfig(4, 4),
}


def quantize_fp8_token_group(x: torch.Tensor, group: int = GROUP,
                             out: tuple[torch.Tensor, torch.Tensor] | None = None,
                             norm: tuple[torch.Tensor, float] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations [..., K] -> (E4M3 data [..., K], fp32 scale [..., ceil(K/group)]), written into
    ``out`` (contiguous tensors of those shapes) where given. ``norm`` (weight [K], eps): of
    rms_norm(x) instead, in the same launch."""
    k = x.shape[-1]
    flat = x.reshape(-1, k)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    t = flat.shape[0]
    groups = triton.cdiv(k, group)
    if out is None:
        data = torch.empty(t, k, dtype=torch.float8_e4m3fn, device=x.device)
        scale = torch.empty(t, groups, dtype=torch.float32, device=x.device)
    else:
        data, scale = out[0].view(t, k), out[1].view(t, groups)
    norm_weight, eps = norm or (flat, 0.0)
    if norm is not None and norm_weight.shape != (k,):
        raise ValueError(f"norm weight shape {tuple(norm_weight.shape)} does not match the activations' {k}")
    cfg = config_for(QUANT, x.device)
    if t:
        _token_group_quant_kernel[(triton.cdiv(t, cfg.block_t), groups)](
            flat, data, scale, norm_weight, t, k, flat.stride(0), data.stride(0), scale.stride(0), eps,
            BLOCK_T=cfg.block_t, GROUP_K=group, NORM=norm is not None,
            ROUND_BEFORE_WEIGHT=norm is not None and norm_weight.dtype == x.dtype and x.dtype != torch.float32,
            num_warps=cfg.num_warps, **launch_options(x.device))
    return data.view(x.shape), scale.view(*x.shape[:-1], groups)
