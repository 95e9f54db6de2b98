"""MXFP8 (OCP MX v1.0): E4M3 data with one E8M0 power-of-two scale per 32 values along K.

Quantization matches ``core.native.quant.quantize_mxfp8`` bit for bit: the shared exponent is
floor(log2(amax)) - 8, read straight from amax's fp32 exponent field (frexp's answer for every
finite amax, zero and subnormals included, once clamped to E8M0's range). The GEMM hands both
E4M3 operands and their scales to ``tl.dot_scaled``: a block-scaled MMA on sm_100
(``tcgen05.mma ... block_scale``) and gfx950 (``v_mfma_scale_f32``); elsewhere triton scales
and upcasts to bf16 before an ordinary MMA, which is exact for E4M3 times a power of two.

On sm_90 that upcast is the dequantize-in-registers path: each E4M3 tile is converted
(``cvt.rn.f16x2.e4m3x2``), scaled by its E8M0 exponents in registers and fed to a bf16 ``wgmma``,
so HBM carries 8.25 bits a value and no dequantized copy is written. An FP8 ``wgmma`` is not used:
one instruction covers K = 32, exactly one scale block, so with a scale per 32 on both operands
every instruction's product would need its own M x N fp32 promotion on the CUDA cores (DeepGEMM
promotes once per 128), which costs as much as the MMA and stalls the asynchronous pipeline;
reaching it would mean requantizing to coarser scales, which is another format.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp8_gemm import GemmConfig, GemmTuning, output_for, store_tile, tile_of, unit_inner_stride
from .fp8_quant import FP8_MAX, e4m3_rne, e8m0_to_float
from .target import config_for

MX_BLOCK = 32
E8M0_MAX = tl.constexpr(254)  # 255 is NaN


@triton.jit
def mxfp8_blocks(x):
    """fp32 blocks [..., MX] (the last axis one block) -> (E4M3 [..., MX], biased E8M0 exponents [...]
    int32): each block's shared exponent is floor(log2(amax)) - 8, read from amax's fp32 exponent field."""
    last: tl.constexpr = len(x.shape) - 1
    amax = tl.max(tl.abs(x), axis=last)
    exponent = (amax.to(tl.int32, bitcast=True) >> 23) - 8
    biased = tl.minimum(tl.maximum(exponent, 0), E8M0_MAX)
    y = tl.math.div_rn(x, tl.expand_dims(e8m0_to_float(biased), last))
    return e4m3_rne(tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)), biased


@triton.jit
def _mxfp8_quant_kernel(x_ptr, data_ptr, scale_ptr, T, blocks_per_row, stride_x, stride_data, stride_scale,
                        BLOCK_B: tl.constexpr, MX: tl.constexpr):
    """One program: BLOCK_B consecutive blocks of MX values, counted row-major over [T, K / MX]."""
    blk = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    row = (blk // blocks_per_row).to(tl.int64)
    col = blk % blocks_per_row
    valid = row < T
    lanes = col[:, None] * MX + tl.arange(0, MX)[None, :]
    x = tl.load(x_ptr + row[:, None] * stride_x + lanes, mask=valid[:, None], other=0.0).to(tl.float32)
    data, biased = mxfp8_blocks(x)
    tl.store(data_ptr + row[:, None] * stride_data + lanes, data, mask=valid[:, None])
    tl.store(scale_ptr + row * stride_scale + col, biased.to(tl.uint8), mask=valid)


QUANT_BLOCKS = {"cuda": (64, 4), "hip": (64, 4), "default": (16, 4)}  # (blocks per program, num_warps)


def quantize_mxfp8(x: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor] | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., K] -> (E4M3 data [..., K], uint8 E8M0 scale [..., K/32]), written into ``out``
    (contiguous tensors of those shapes) where given."""
    k = x.shape[-1]
    if k % MX_BLOCK:
        raise ValueError(f"MXFP8 needs the last axis ({k}) to be a multiple of the block size {MX_BLOCK}")
    flat = x.reshape(-1, k)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    t, per_row = flat.shape[0], k // MX_BLOCK
    if out is None:
        data = torch.empty(t, k, dtype=torch.float8_e4m3fn, device=x.device)
        scale = torch.empty(t, per_row, dtype=torch.uint8, device=x.device)
    else:
        data, scale = out[0].view(t, k), out[1].view(t, per_row)
    block_b, num_warps = config_for(QUANT_BLOCKS, x.device)
    if t * per_row:
        _mxfp8_quant_kernel[(triton.cdiv(t * per_row, block_b),)](
            flat, data, scale, t, per_row, flat.stride(0), data.stride(0), scale.stride(0),
            BLOCK_B=block_b, MX=MX_BLOCK, num_warps=num_warps)
    return data.view(x.shape), scale.view(*x.shape[:-1], per_row)


# sm_100 and gfx950 run the block-scaled MMA natively; sm_90 and gfx942 emulate it in bf16.
# sm_100 keeps BLOCK_M at 128 even for decode: at 64 triton falls back to the bf16 emulation.
MXFP8_GEMM = {
    "sm_90": GemmTuning(GemmConfig(64, 64, 128, 1, 4, 4), GemmConfig(128, 128, 128, 8, 8, 3)),
    "sm_100": GemmTuning(GemmConfig(128, 64, 128, 1, 4, 4), GemmConfig(128, 128, 128, 8, 4, 3)),
    "gfx942": GemmTuning(GemmConfig(32, 64, 128, 1, 4, 2), GemmConfig(128, 128, 64, 8, 8, 2)),
    "gfx950": GemmTuning(GemmConfig(32, 64, 128, 1, 4, 2), GemmConfig(128, 128, 128, 8, 8, 2)),
    "default": GemmTuning(GemmConfig(16, 32, 64, 1, 4, 1), GemmConfig(32, 32, 64, 2, 4, 1), small_m=16),
}


# the grouped output projection on unquantized (bf16, fp16, fp32) operands: the same kernel without
# the scales, at half BLOCK_K (two bytes a value); smem, LDS and registers checked by the AOT tests
DENSE_GROUPED_GEMM = {
    "sm_90": GemmTuning(GemmConfig(64, 64, 64, 1, 4, 4), GemmConfig(128, 128, 64, 8, 8, 3)),
    "sm_100": GemmTuning(GemmConfig(64, 64, 64, 1, 4, 4), GemmConfig(128, 128, 64, 8, 4, 3)),
    "gfx942": GemmTuning(GemmConfig(32, 64, 64, 1, 4, 2), GemmConfig(128, 128, 32, 8, 8, 2)),
    "gfx950": GemmTuning(GemmConfig(32, 64, 64, 1, 4, 2), GemmConfig(128, 128, 64, 8, 8, 2)),
    "default": GemmTuning(GemmConfig(16, 32, 32, 1, 4, 1), GemmConfig(32, 32, 32, 2, 4, 1), small_m=16),
}


@triton.jit
def group_tile(a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, rm, rn, M, N, K, stride_am, stride_as, stride_bn, stride_bs,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MX: tl.constexpr,
               SCALED: tl.constexpr, UPCAST: tl.constexpr):
    """fp32 [BLOCK_M, BLOCK_N]: rows ``rm`` of a [M, K] times rows ``rn`` of b [N, K] (pointers already
    at the group's slice), rows and columns past M and N rereading the last. Without ``SCALED`` the
    operands are unquantized, of one dtype, and go to an ordinary dot ("ieee": fp32 operands
    multiplied in fp32, not TF32; bf16 and fp16 ones as ever). ``UPCAST`` (the interpreter, whose
    dot multiplies bf16's raw bits) feeds it fp32 copies: the same exact products, summed in fp32
    as the MMA does."""
    rk = tl.arange(0, BLOCK_K)
    rs = tl.arange(0, BLOCK_K // MX)
    am = (rm % M).to(tl.int64)
    bn = (rn % N).to(tl.int64)
    a_ptrs = a_ptr + am[:, None] * stride_am + rk[None, :]
    b_ptrs = b_ptr + bn[None, :] * stride_bn + rk[:, None]
    a_scale_ptrs = a_scale_ptr + am[:, None] * stride_as + rs[None, :]
    b_scale_ptrs = b_scale_ptr + bn[:, None] * stride_bs + rs[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_left = K - k0
        a = tl.load(a_ptrs, mask=rk[None, :] < k_left, other=0.0)
        b = tl.load(b_ptrs, mask=rk[:, None] < k_left, other=0.0)
        if SCALED:
            # scales past K are 2**0: their data is zero, and a NaN scale (255) would poison the sum
            a_scale = tl.load(a_scale_ptrs, mask=rs[None, :] * MX < k_left, other=127)
            b_scale = tl.load(b_scale_ptrs, mask=rs[None, :] * MX < k_left, other=127)
            acc = tl.dot_scaled(a, a_scale, "e4m3", b, b_scale, "e4m3", acc)
        else:
            if UPCAST:
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision="ieee")
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
        a_scale_ptrs += BLOCK_K // MX
        b_scale_ptrs += BLOCK_K // MX
    return acc


@triton.jit
def _mxfp8_gemm_kernel(a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, bias_ptr, c_ptr, M, N, K,
                       stride_am, stride_ag, stride_as, stride_asg, stride_bn, stride_bs, stride_cm,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       GROUP_M: tl.constexpr, MX: tl.constexpr, HAS_BIAS: tl.constexpr,
                       SCALED: tl.constexpr, UPCAST: tl.constexpr):
    """Group ``program_id(1)``: its N columns of c from its slice of a and its N rows of b
    (``group_tile``)."""
    group = tl.program_id(1).to(tl.int64)
    a_ptr += group * stride_ag
    a_scale_ptr += group * stride_asg
    b_ptr += group * N * stride_bn
    b_scale_ptr += group * N * stride_bs
    c_ptr += group * N
    if HAS_BIAS:
        bias_ptr += group * N
    pid_m, pid_n = tile_of(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = group_tile(a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, rm, rn, M, N, K, stride_am, stride_as, stride_bn,
                     stride_bs, BLOCK_M, BLOCK_N, BLOCK_K, MX, SCALED, UPCAST)
    store_tile(acc, bias_ptr, c_ptr, rm, rn, M, N, stride_cm, HAS_BIAS)


def _check_operands(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                    groups: int) -> tuple[int, int, int]:
    """(M, N per group, K) of a [M, (G,) K] and b [G * N, K] with their per-32 scales."""
    m, k = a.shape[0], a.shape[-1]
    n = b.shape[0] // groups
    if b.shape != (groups * n, k) or k % MX_BLOCK:
        raise ValueError(f"a is {list(a.shape)} and b {list(b.shape)}: K must match and be a multiple of "
                         f"{MX_BLOCK}, and b's rows split into {groups} groups")
    if a_scale.shape != (*a.shape[:-1], k // MX_BLOCK) or b_scale.shape != (groups * n, k // MX_BLOCK):
        raise ValueError(f"scales {list(a_scale.shape)} and {list(b_scale.shape)} do not fit "
                         f"a {list(a.shape)} and b {list(b.shape)} in blocks of {MX_BLOCK}")
    return m, n, k


def _launch(a, a_scale, b, b_scale, bias, out, m, n, k, groups, scaled=True):
    if m == 0 or n == 0:
        return out
    cfg = config_for(MXFP8_GEMM if scaled else DENSE_GROUPED_GEMM, a.device).for_m(m)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n), groups)
    _mxfp8_gemm_kernel[grid](
        a, a_scale, b, b_scale, bias, out, m, n, k,
        a.stride(0), a.stride(1) if a.dim() == 3 else 0, a_scale.stride(0),
        a_scale.stride(1) if a.dim() == 3 else 0, b.stride(0), b_scale.stride(0), out.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        MX=MX_BLOCK, HAS_BIAS=bias is not None, SCALED=scaled, UPCAST=a.device.type == "cpu",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


def mxfp8_gemm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
               out_dtype: torch.dtype = torch.bfloat16, bias: torch.Tensor | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """a [M, K] and b [N, K] E4M3 with E8M0 scales [M, K/32] and [N, K/32] (+ bias [N]) -> [M, N]
    in ``out_dtype``, or written into ``out`` ([M, N], unit stride along N)."""
    if a.dim() != 2:
        raise ValueError(f"a must be [M, K], not {list(a.shape)}")
    m, n, k = _check_operands(a, a_scale, b, b_scale, 1)
    a, a_scale, b, b_scale = unit_inner_stride(a, a_scale, b, b_scale)
    return _launch(a, a_scale, b, b_scale, bias, output_for(m, n, out_dtype, a.device, out), m, n, k, 1)


def mxfp8_grouped_gemm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                       out_dtype: torch.dtype = torch.bfloat16, out: torch.Tensor | None = None) -> torch.Tensor:
    """a [M, G, K] E4M3 with E8M0 scales [M, G, K/32], b [G * N, K] with [G * N, K/32] -> [M, G * N]
    in ``out_dtype`` (or written into ``out``), group g's N columns being a[:, g] @ b[g*N:(g+1)*N].T:
    one launch for every group (DeepSeek-V4's grouped output projection)."""
    if a.dim() != 3:
        raise ValueError(f"a must be [M, G, K], not {list(a.shape)}")
    m, n, k = _check_operands(a, a_scale, b, b_scale, a.shape[1])
    a, a_scale, b, b_scale = unit_inner_stride(a, a_scale, b, b_scale)
    out = output_for(m, a.shape[1] * n, out_dtype, a.device, out)
    return _launch(a, a_scale, b, b_scale, None, out, m, n, k, a.shape[1])


def grouped_gemm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """a [M, G, K] and b [G * N, K] of one dtype (bf16, fp16 or fp32) -> [M, G * N] in it (or
    written into ``out``): ``mxfp8_grouped_gemm`` on unquantized operands, one launch for every
    group, accumulated in fp32 and rounded once."""
    if a.dim() != 3 or b.dim() != 2 or b.shape[-1] != a.shape[-1] or b.shape[0] % a.shape[1]:
        raise ValueError(f"a [M, G, K] and b [G * N, K] do not fit: {list(a.shape)} and {list(b.shape)}")
    if a.dtype != b.dtype:
        raise ValueError(f"a is {a.dtype} and b {b.dtype}: the grouped GEMM takes them in one dtype")
    m, groups, k = a.shape
    n = b.shape[0] // groups
    a, b = unit_inner_stride(a, b)
    out = output_for(m, groups * n, a.dtype, a.device, out)
    return _launch(a, a, b, b, None, out, m, n, k, groups, scaled=False)


def mxfp8_linear(x: torch.Tensor, weight_data: torch.Tensor, weight_scale: torch.Tensor,
                 bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [..., K] @ dequantized weight.T (+ bias) -> [..., N]: x is quantized to MXFP8 first, so
    both operands reach the block-scaled MMA. The output is in ``out_dtype``, by default x's dtype."""
    k = x.shape[-1]
    data, scale = quantize_mxfp8(x.reshape(-1, k))
    out = mxfp8_gemm(data, scale, weight_data, weight_scale, out_dtype or x.dtype, bias)
    return out.view(*x.shape[:-1], weight_data.shape[0])
