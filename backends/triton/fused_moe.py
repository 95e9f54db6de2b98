"""Fused MoE experts: two grouped GEMMs over the assignments sorted and aligned by expert.

gate/up: a program takes BLOCK_M rows of one expert (see moe_align) and BLOCK_N columns of the
intermediate, multiplies the rows' tokens by that expert's gate rows and up rows in one K loop,
and applies SwiGLU in its epilogue, so the [T * top_k, 2I] projection is never stored. down: the
same grouped GEMM over the SwiGLU output, ending in the weighted combine: its rows are stored in
assignment order, [T, top_k, H], and the program that stores the last of a token's rows of a
column tile (an integer arrival count per token and tile says which) sums that token's rows, each
times its routing weight, in k order into the output. So nothing runs between the down GEMM and
the residual, and the sum is deterministic (no floating-point atomics). An expert id -1 names no
expert (an expert-parallel exchange's padding, or a token's experts held by other ranks): the
alignment places it nowhere and the combine leaves it out, so a token's output is the sum over its
real experts, and a token whose ids are all -1 is not written at all (its row of the output stays
as it was: what accumulating zero leaves).

Rounding follows core/native/moe.py: each GEMM's fp32 result is rounded to x's dtype; SwiGLU is
the native ``_swiglu`` (the DeepSeek-V4 clamp, silu in fp32 rounded, times up rounded); the
weighted top-k sum is in fp32, rounded once.

FP8 weights (E4M3 with one fp32 scale per B x B block of each expert, what ``quantize_fp8_block``
makes of each expert's matrices: B = 128, or DeepSeek-V4.1's 32, which the scales' shape says) meet
E4M3 activations with one scale per token and B channels, scaled per K step in fp32 as the FP8
block GEMM does; a K step stays within one block, so 32-blocks take K steps of 32.

FP4 weights (DeepSeek-V4's routed experts: E2M1 packed two per byte along K, one E8M0 scale per
32) stay packed in memory, a quarter of bf16's bytes. On sm_100 and gfx950 the activations are
quantized to MXFP8 and both operands go to ``tl.dot_scaled``, the native block-scaled MMA
(``tcgen05.mma ... block_scale``, ``v_mfma_scale_f32``). Elsewhere (sm_90, gfx942) each weight
tile is unpacked in registers to exact values (fp4.py: on CUDA with bf16 activations a few integer
instructions and two packed multiplies per two weights) and multiplied as the dot's first operand,
the block's tokens its second, so on sm_90 the unpacked tile stays in registers for wgmma and a
decode block of 16 tokens still takes the 64-row wgmma: the product is the native one on the
dequantized weights, up to summation order.
"""

from __future__ import annotations

from functools import partial

import torch
import triton
import triton.language as tl

from engine.core.families.linear import fp8_block_edge

from .fp8_gemm import GemmConfig, output_for, tile_of, unit_inner_stride
from .fp4 import fp4_rows, fp4_rows_ptx
from .fp8_quant import GROUP, quantize_fp8_token_group, token_groups
from .moe_align import ExpertBlocks, align_by_expert
from .moe_tiles import (FP4_PTX_UNPACK, FP4_SCALED_MMA, MOE_FP4_GEMM, MOE_TUNING, check_fp8_steps, moe_config,
                        ptx_unpack_fits, stages_that_fit)
from .mxfp8 import MX_BLOCK, mxfp8_blocks, quantize_mxfp8
from .pdl import launch_options, wait_for_prior
from .target import config_for

FP8 = torch.float8_e4m3fn
MX = tl.constexpr(MX_BLOCK)
UNQUANTIZED = (torch.float32, torch.float16, torch.bfloat16)
PACKED_FP4 = torch.uint8  # E2M1 weights, two per byte along K
FP4_SCALE = torch.uint8  # E8M0, one per 32 along K
ACTIVATIONS = ("silu",)
@triton.jit
def _clear_arrivals(arrivals_ptr, token, valid, tiles, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """arrivals[token, :] = 0 for the block's valid rows (a token of several blocks is cleared by each)."""
    for t0 in range(0, tiles, BLOCK_N):
        rt = t0 + tl.arange(0, BLOCK_N)
        tl.store(arrivals_ptr + token[:, None] * tiles + rt[None, :], tl.zeros((BLOCK_M, BLOCK_N), tl.int32),
                 mask=valid[:, None] & (rt[None, :] < tiles))


@triton.jit
def _combine(c_ptr, out_ptr, weight_ptr, expert_ptr, arrivals_ptr, ids, valid, rn, pid_n, N, top_k, tiles,
             stride_cm, stride_om, stride_wt, stride_et, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             ACCUMULATE: tl.constexpr):
    """out[t, tile] = sum over k of c[t * top_k + k, tile] * weight[t, k], in fp32 and in k order,
    over the k whose expert id (expert [T, top_k], row stride stride_et) is not -1, by whichever
    program stores the last of those rows of this column tile; ACCUMULATE: out[t, tile] plus that
    sum rounded to out's dtype, as torch adds two such tensors (another stack's output, written by
    an earlier launch). The rows of -1 ids are never stored, so they are neither awaited nor read.

    Each program counts its stored rows into arrivals[t, pid_n] (an integer atomic, after a barrier:
    every row of the tile is stored before any is counted; acquire-release at GPU scope, so the
    program that sees the count reach top_k sees every row counted before). Which program that is
    varies from run to run, but what it sums, and in what order, does not: the result is
    deterministic. The rows are read past L1, which may hold lines of an earlier kernel. The counts
    are the launch's own (``arrivals_for``, cleared by the gate/up GEMM before), so launches share
    no buffer and a graph replays them as captured.
    """
    tl.debug_barrier()
    token = tl.where(valid, ids, 0) // top_k
    arrived = tl.atomic_add(arrivals_ptr + token * tiles + pid_n, 1, mask=valid, sem="acq_rel", scope="gpu")
    pairs = tl.zeros((BLOCK_M,), dtype=tl.int32)  # the token's pairs with an expert, whose rows arrive
    for k in range(top_k):
        pairs += (tl.load(expert_ptr + token * stride_et + k, mask=valid, other=-1) >= 0).to(tl.int32)
    last = valid & (arrived == pairs - 1)
    first_row = token.to(tl.int64) * top_k
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(top_k):
        real = last & (tl.load(expert_ptr + token * stride_et + k, mask=last, other=-1) >= 0)
        weight = tl.load(weight_ptr + token * stride_wt + k, mask=real, other=0.0)
        row = tl.load(c_ptr + (first_row + k)[:, None] * stride_cm + rn[None, :],
                      mask=real[:, None] & (rn[None, :] < N), other=0.0, cache_modifier=".cg")
        total += row.to(tl.float32) * weight[:, None]
    mask = last[:, None] & (rn[None, :] < N)
    out_ptrs = out_ptr + token[:, None].to(tl.int64) * stride_om + rn[None, :]
    total = total.to(out_ptr.dtype.element_ty)
    if ACCUMULATE:
        total = (tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32) + total.to(tl.float32)).to(total.dtype)
    tl.store(out_ptrs, total, mask=mask)


@triton.jit
def _fp4_row_products(a_ptrs, b_ptrs, b_scale_ptrs, up_offset, up_scale_offset, K, GATED: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                      PTX_UNPACK: tl.constexpr, A_CACHE: tl.constexpr):
    """The K loop of FP4 weights unpacked in registers -> (gate or down, up) products [BLOCK_M, BLOCK_N].

    The weights are the dot's first operand (rows of the expert against the block's tokens, the
    products transposed once at the end), so on sm_90 the unpacked tile stays in registers and only
    the activations pass through shared memory. Bytes past K are 0 and their scales 2**0 (a NaN
    scale would poison the sum)."""
    rk = tl.arange(0, BLOCK_K)
    rb = tl.arange(0, BLOCK_K // 2)
    rs = tl.arange(0, BLOCK_K // 32)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, cache_modifier=A_CACHE)
            b = tl.load(b_ptrs)
            b_scale = tl.load(b_scale_ptrs)
        else:
            k_left = K - k0
            a = tl.load(a_ptrs, mask=rk[None, :] < k_left, other=0.0, cache_modifier=A_CACHE)
            b = tl.load(b_ptrs, mask=2 * rb[None, :] < k_left, other=0)
            b_scale = tl.load(b_scale_ptrs, mask=rs[None, :] * 32 < k_left, other=127)
        tokens = tl.trans(a)
        if PTX_UNPACK:
            acc = tl.dot(fp4_rows_ptx(b, b_scale, BLOCK_N, BLOCK_K), tokens, acc)
        else:
            acc = tl.dot(fp4_rows(b, b_scale, a.dtype, BLOCK_N, BLOCK_K), tokens, acc)
        if GATED:
            if EVEN_K:
                up = tl.load(b_ptrs + up_offset)
                up_scale = tl.load(b_scale_ptrs + up_scale_offset)
            else:
                up = tl.load(b_ptrs + up_offset, mask=2 * rb[None, :] < k_left, other=0)
                up_scale = tl.load(b_scale_ptrs + up_scale_offset, mask=rs[None, :] * 32 < k_left, other=127)
            if PTX_UNPACK:
                acc_up = tl.dot(fp4_rows_ptx(up, up_scale, BLOCK_N, BLOCK_K), tokens, acc_up)
            else:
                acc_up = tl.dot(fp4_rows(up, up_scale, a.dtype, BLOCK_N, BLOCK_K), tokens, acc_up)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K // 2
        b_scale_ptrs += BLOCK_K // 32
    return tl.trans(acc), tl.trans(acc_up)


@triton.jit
def _mxfp8_tile(a, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """An activation tile [BLOCK_M, BLOCK_K] (zeros past K) -> MXFP8: E4M3 and uint8 E8M0 exponents
    [BLOCK_M, BLOCK_K / 32] (``mxfp8_blocks``)."""
    data, biased = mxfp8_blocks(a.to(tl.float32).reshape(BLOCK_M * (BLOCK_K // MX), MX))
    return data.reshape(BLOCK_M, BLOCK_K), biased.to(tl.uint8).reshape(BLOCK_M, BLOCK_K // MX)


@triton.jit
def _moe_gemm_kernel(a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, c_ptr, out_ptr, topk_weight_ptr, topk_id_ptr,
                     arrivals_ptr, sorted_ids_ptr, block_expert_ptr, num_padded_ptr,
                     M, N, K, num_assignments, rows_per_a, swiglu_limit, top_k, tiles,
                     stride_am, stride_as, stride_be, stride_bn, stride_bse, stride_bsn, stride_cm, stride_om,
                     stride_wt, stride_it,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                     GATED: tl.constexpr, HAS_LIMIT: tl.constexpr,
                     FP8: tl.constexpr, SCALE_BLOCK: tl.constexpr, PDL: tl.constexpr,
                     FP4: tl.constexpr, SCALED_MMA: tl.constexpr, EVEN_K: tl.constexpr,
                     PTX_UNPACK: tl.constexpr, QUANTIZE_A: tl.constexpr, ACCUMULATE: tl.constexpr):
    """c[id] = a[id // rows_per_a] @ b[expert].T for the sorted ids of one M block.

    GATED (gate/up): b holds gate rows [0, N) and up rows [N, 2N); c gets SwiGLU of the two
    products, and the block's tokens' arrival counts [T, tiles] are cleared for the down GEMM.
    Otherwise (down): c gets the product, and each token's rows are combined into out (see
    ``_combine``) with the routing weights and expert ids [T, top_k] (row strides stride_wt and
    stride_it: a column slice of a wider routing reads in place), added to what out holds with
    ACCUMULATE.
    FP4: b is packed E2M1 with E8M0 scales per 32 along K; with SCALED_MMA a is MXFP8 and both go
    to ``tl.dot_scaled``, otherwise ``_fp4_row_products`` unpacks the weights in registers (with
    PTX_UNPACK through ``fp4_rows_ptx``). EVEN_K: K is a multiple of BLOCK_K (no masks in that loop).
    QUANTIZE_A (FP8, or FP4 with SCALED_MMA): a is unquantized and each K step's tile is quantized as
    it is loaded (``token_groups``, ``_mxfp8_tile``), what the quantization launch would have stored,
    to the bit.
    """
    wait_for_prior(PDL)
    pid_m, pid_n = tile_of(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M < tl.load(num_padded_ptr):
        expert_tile(pid_m, pid_n, a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, c_ptr, out_ptr, topk_weight_ptr,
                    topk_id_ptr, arrivals_ptr, sorted_ids_ptr, block_expert_ptr, N, K, num_assignments, rows_per_a,
                    swiglu_limit, top_k, tiles, stride_am, stride_as, stride_be, stride_bn, stride_bse, stride_bsn,
                    stride_cm, stride_om, stride_wt, stride_it, BLOCK_M, BLOCK_N, BLOCK_K, GATED, HAS_LIMIT, FP8,
                    SCALE_BLOCK, FP4, SCALED_MMA, EVEN_K, PTX_UNPACK, QUANTIZE_A, ACCUMULATE, GATED, "")


@triton.jit
def expert_tile(pid_m, pid_n, a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, c_ptr, out_ptr, topk_weight_ptr, topk_id_ptr,
                arrivals_ptr, sorted_ids_ptr, block_expert_ptr, N, K, num_assignments, rows_per_a, swiglu_limit, top_k,
                tiles, stride_am, stride_as, stride_be, stride_bn, stride_bse, stride_bsn, stride_cm, stride_om,
                stride_wt, stride_it,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GATED: tl.constexpr,
                HAS_LIMIT: tl.constexpr, FP8: tl.constexpr, SCALE_BLOCK: tl.constexpr, FP4: tl.constexpr,
                SCALED_MMA: tl.constexpr, EVEN_K: tl.constexpr, PTX_UNPACK: tl.constexpr, QUANTIZE_A: tl.constexpr,
                ACCUMULATE: tl.constexpr, CLEAR: tl.constexpr, A_CACHE: tl.constexpr):
    """Tile (pid_m, pid_n) of ``_moe_gemm_kernel``, of a block in use; CLEAR: clear its tokens' arrival
    counts (the gate/up GEMM does, for the down GEMM of a later launch); A_CACHE: how a's tiles are
    loaded (".cg" past L1 where a was written by the same launch)."""
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    ids = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = ids < num_assignments
    # padding rows read row 0 and columns past N read column N-1 again; neither is stored
    am = tl.where(valid, ids // rows_per_a, 0).to(tl.int64)
    if CLEAR:
        if pid_n == 0:
            _clear_arrivals(arrivals_ptr, am, valid, tiles, BLOCK_M, BLOCK_N)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    bn = (rn % N).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + am[:, None] * stride_am + rk[None, :]
    if FP4:
        B_STEP: tl.constexpr = BLOCK_K // 2
        rb = tl.arange(0, B_STEP)  # packed bytes along K
        rs = tl.arange(0, BLOCK_K // SCALE_BLOCK)  # scales along K
        if SCALED_MMA:
            b_ptrs = b_ptr + expert * stride_be + bn[None, :] * stride_bn + rb[:, None]
            b_scale_ptrs = b_scale_ptr + expert * stride_bse + bn[None, :] * stride_bsn + rs[:, None]
            if not QUANTIZE_A:
                a_scale_ptrs = a_scale_ptr + am[:, None] * stride_as + rs[None, :]
        else:  # weight rows, the dot's first operand
            b_ptrs = b_ptr + expert * stride_be + bn[:, None] * stride_bn + rb[None, :]
            b_scale_ptrs = b_scale_ptr + expert * stride_bse + bn[:, None] * stride_bsn + rs[None, :]
    else:
        B_STEP: tl.constexpr = BLOCK_K
        b_ptrs = b_ptr + expert * stride_be + bn[None, :] * stride_bn + rk[:, None]
    if FP8:
        if not QUANTIZE_A:
            a_scale_ptrs = a_scale_ptr + am * stride_as
        b_scale_ptrs = b_scale_ptr + expert * stride_bse + (bn // SCALE_BLOCK) * stride_bsn
        up_scale_ptrs = b_scale_ptr + expert * stride_bse + ((bn + N) // SCALE_BLOCK) * stride_bsn
    up_offset = N * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if GATED:
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if FP4 and not SCALED_MMA:
        acc, acc_up = _fp4_row_products(a_ptrs, b_ptrs, b_scale_ptrs, up_offset, N * stride_bsn, K, GATED,
                                        BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, PTX_UNPACK, A_CACHE)
    else:
        for k0 in range(0, K, BLOCK_K):
            k_left = K - k0
            a = tl.load(a_ptrs, mask=rk[None, :] < k_left, other=0.0, cache_modifier=A_CACHE)
            if FP4:
                # bytes and scales past K are 0 and 2**0 (a NaN scale would poison the sum)
                b = tl.load(b_ptrs, mask=2 * rb[:, None] < k_left, other=0)
                b_scale = tl.load(b_scale_ptrs, mask=rs[:, None] * SCALE_BLOCK < k_left, other=127)
                if GATED:
                    up = tl.load(b_ptrs + up_offset, mask=2 * rb[:, None] < k_left, other=0)
                    up_scale = tl.load(b_scale_ptrs + N * stride_bsn, mask=rs[:, None] * SCALE_BLOCK < k_left,
                                       other=127)
                if QUANTIZE_A:
                    a, a_scale = _mxfp8_tile(a, BLOCK_M, BLOCK_K)
                else:
                    a_scale = tl.load(a_scale_ptrs, mask=rs[None, :] * SCALE_BLOCK < k_left, other=127)
                    a_scale_ptrs += BLOCK_K // SCALE_BLOCK
                acc = tl.dot_scaled(a, a_scale, "e4m3", b, tl.trans(b_scale), "e2m1", acc)
                if GATED:
                    acc_up = tl.dot_scaled(a, a_scale, "e4m3", up, tl.trans(up_scale), "e2m1", acc_up)
                b_scale_ptrs += BLOCK_K // SCALE_BLOCK
            else:
                b = tl.load(b_ptrs, mask=rk[:, None] < k_left, other=0.0)
                if GATED:
                    up = tl.load(b_ptrs + up_offset, mask=rk[:, None] < k_left, other=0.0)
                if FP8:
                    group = k0 // SCALE_BLOCK
                    if QUANTIZE_A:  # BLOCK_K == SCALE_BLOCK: the tile is one group of each row
                        a, a_scale = token_groups(a.to(tl.float32))
                    else:
                        a_scale = tl.load(a_scale_ptrs + group)
                    acc += tl.dot(a, b) * a_scale[:, None] * tl.load(b_scale_ptrs + group)[None, :]
                    if GATED:
                        acc_up += tl.dot(a, up) * a_scale[:, None] * tl.load(up_scale_ptrs + group)[None, :]
                else:
                    acc = tl.dot(a, b, acc)
                    if GATED:
                        acc_up = tl.dot(a, up, acc_up)
            a_ptrs += BLOCK_K
            b_ptrs += B_STEP
    dtype = c_ptr.dtype.element_ty
    out = acc.to(dtype).to(tl.float32)
    if GATED:
        up_out = acc_up.to(dtype).to(tl.float32)
        if HAS_LIMIT:
            out = tl.minimum(out, swiglu_limit)
            up_out = tl.minimum(tl.maximum(up_out, -swiglu_limit), swiglu_limit)
        out = (out / (1.0 + tl.exp(-out))).to(dtype).to(tl.float32) * up_out
    c_ptrs = c_ptr + ids[:, None].to(tl.int64) * stride_cm + rn[None, :]
    tl.store(c_ptrs, out.to(dtype), mask=valid[:, None] & (rn[None, :] < N))
    if not GATED:
        _combine(c_ptr, out_ptr, topk_weight_ptr, topk_id_ptr, arrivals_ptr, ids, valid, rn, pid_n, N, top_k, tiles,
                 stride_cm, stride_om, stride_wt, stride_it, BLOCK_M, BLOCK_N, ACCUMULATE)


def fp8_expert_block(w: torch.Tensor, scale: torch.Tensor | None) -> int | None:
    """The block edge of FP8 experts ``w`` [E, N, K] with fp32 scales [E, ceil(N/B), ceil(K/B)] (B,
    128 or 32, from their shape); None for other weights."""
    if w.dtype != FP8:
        return None
    if scale is None or scale.dim() != 3:
        raise ValueError(f"FP8 expert weights {list(w.shape)} need their scales [E, N / B, K / B]")
    return fp8_block_edge(tuple(w.shape[1:]), tuple(scale.shape[1:]))


def _weight_format(a, a_scale, b, b_scale, quantize_a: bool = False) -> str:
    """"dense", "fp8_block", "fp4" (dequantized in registers) or "fp4_scaled" (MXFP8 activations,
    ``tl.dot_scaled``), after checking that activations, weights and scales go together;
    ``quantize_a``: the activations come unquantized, for the kernel to quantize as it loads them."""
    if quantize_a:
        if a_scale is not None or a.dtype not in UNQUANTIZED or b.dtype not in (FP8, PACKED_FP4):
            raise ValueError("activations quantized in the GEMM come unquantized, to FP8 or FP4 weights")
        if b_scale is None or b_scale.dtype != (FP4_SCALE if b.dtype == PACKED_FP4 else torch.float32):
            raise ValueError(f"{b.dtype} expert weights need their scales")
        return "fp8_block" if b.dtype == FP8 else "fp4_scaled"
    if b.dtype == PACKED_FP4:
        if b_scale is None or b_scale.dtype != FP4_SCALE:
            raise ValueError("FP4 expert weights need their uint8 E8M0 scales")
        if a.dtype == FP8:
            if a_scale is None or a_scale.dtype != torch.uint8:
                raise ValueError("MXFP8 activations need their uint8 E8M0 scales")
            return "fp4_scaled"
        if a_scale is not None or a.dtype not in UNQUANTIZED:
            raise ValueError(f"FP4 expert weights take MXFP8 or unquantized activations, not {a.dtype}")
        return "fp4"
    fp8 = b.dtype == FP8
    if fp8 != (a.dtype == FP8) or fp8 != (b_scale is not None) or fp8 != (a_scale is not None):
        raise ValueError("FP8 expert weights need E4M3 activations and scales for both, other weights none")
    if not fp8 and a.dtype != b.dtype:
        raise ValueError(f"activations in {a.dtype} but expert weights in {b.dtype}")
    return "fp8_block" if fp8 else "dense"


def _grouped_gemm(a, a_scale, b, b_scale, blocks: ExpertBlocks, cfg: GemmConfig, n: int, rows_per_a: int,
                  c: torch.Tensor, arrivals: torch.Tensor, *, gated: bool, swiglu_limit: float | None = None,
                  out: torch.Tensor | None = None, topk_weights: torch.Tensor | None = None,
                  topk_ids: torch.Tensor | None = None, quantize_a: bool = False, accumulate: bool = False) -> None:
    if blocks.block_m != cfg.block_m:
        raise ValueError(f"expert blocks of {blocks.block_m} rows do not fit BLOCK_M {cfg.block_m}")
    fmt = _weight_format(a, a_scale, b, b_scale, quantize_a)
    k = a.shape[1]
    block = fp8_expert_block(b, b_scale)
    if fmt == "fp8_block":
        check_fp8_steps(cfg, block, quantize_a)
        if not quantize_a and a_scale.shape != (a.shape[0], triton.cdiv(k, block)):
            raise ValueError(f"activation scales {list(a_scale.shape)} do not fit {list(a.shape)} in groups of "
                             f"{block} (the experts' blocks)")
    if blocks.num_blocks == 0:
        return
    fp4 = fmt.startswith("fp4")
    if b.shape[2] * (2 if fp4 else 1) != k or (fp4 and k % MX_BLOCK):
        raise ValueError(f"expert weights {list(b.shape)} ({fmt}) do not take rows of {k} channels")
    grid = (blocks.num_blocks * triton.cdiv(n, cfg.block_n),)
    a_scale_stride = 0 if a_scale is None else a_scale.stride(0)
    b_scale_strides = (0, 0) if b_scale is None else (b_scale.stride(0), b_scale.stride(1))
    top_k, stride_wt = (1, 0) if topk_weights is None else (topk_weights.shape[1], topk_weights.stride(0))
    _moe_gemm_kernel[grid](
        a, a_scale, b, b_scale, c, out, topk_weights, topk_ids, arrivals, blocks.sorted_ids, blocks.block_expert,
        blocks.num_padded, blocks.sorted_ids.numel(), n, k, blocks.num_assignments, rows_per_a,
        0.0 if swiglu_limit is None else float(swiglu_limit), top_k, arrivals.shape[1],
        a.stride(0), a_scale_stride, b.stride(0), b.stride(1), *b_scale_strides, c.stride(0),
        0 if out is None else out.stride(0), stride_wt, 0 if topk_ids is None else topk_ids.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, GATED=gated,
        HAS_LIMIT=swiglu_limit is not None, FP8=fmt == "fp8_block",
        SCALE_BLOCK=MX_BLOCK if fp4 else block or GROUP, FP4=fp4, SCALED_MMA=fmt == "fp4_scaled",
        EVEN_K=k % cfg.block_k == 0,
        PTX_UNPACK=(fmt == "fp4" and a.dtype == torch.bfloat16 and config_for(FP4_PTX_UNPACK, a.device)
                    and ptx_unpack_fits(cfg)),
        QUANTIZE_A=quantize_a, ACCUMULATE=accumulate,
        num_warps=cfg.num_warps, num_stages=stages_that_fit(cfg, a, b, gated, fp4), **launch_options(a.device))


def arrivals_for(num_tokens: int, hidden: int, cfg: GemmConfig, device: torch.device) -> torch.Tensor:
    """The down GEMM's arrival counts, [T, column tiles of H] int32, left as allocated: ``moe_gate_up``
    clears those of every token it computes, so no launch fills them."""
    return torch.empty(num_tokens, triton.cdiv(hidden, cfg.block_n), dtype=torch.int32, device=device)


def _check_arrivals(arrivals: torch.Tensor, num_tokens: int, hidden: int, cfg: GemmConfig) -> None:
    want = (num_tokens, triton.cdiv(hidden, cfg.block_n))
    if arrivals.shape != want or arrivals.dtype != torch.int32 or not arrivals.is_contiguous():
        raise ValueError(f"arrivals must be contiguous int32 {list(want)} (arrivals_for), not "
                         f"{arrivals.dtype} {list(arrivals.shape)}")


def moe_gate_up(x: torch.Tensor, blocks: ExpertBlocks, gate_up: torch.Tensor, top_k: int, cfg: GemmConfig, *,
                arrivals: torch.Tensor, swiglu_limit: float | None = None, x_scale: torch.Tensor | None = None,
                gate_up_scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                out: torch.Tensor | None = None, quantize: bool = False) -> torch.Tensor:
    """x [T, H] through gate_up [E, 2I, H] (gate rows first) and SwiGLU -> [T * top_k, I], row
    ``t * top_k + k`` for token t's k-th expert; in ``out_dtype`` (by default x's), or into ``out``.
    Clears ``arrivals`` (``arrivals_for``) for the ``moe_down`` that follows. ``quantize``: x comes
    unquantized to FP8 or FP4 weights, quantized tile by tile as it is loaded."""
    x, gate_up = unit_inner_stride(x, gate_up)
    _check_arrivals(arrivals, x.shape[0], x.shape[1], cfg)
    inner = gate_up.shape[1] // 2
    out = output_for(blocks.num_assignments, inner, out_dtype or x.dtype, x.device, out)
    _grouped_gemm(x, x_scale, gate_up, gate_up_scale, blocks, cfg, inner, top_k, out, arrivals, gated=True,
                  swiglu_limit=swiglu_limit, quantize_a=quantize)
    return out


def moe_down(h: torch.Tensor, blocks: ExpertBlocks, down: torch.Tensor, topk_weights: torch.Tensor,
             topk_ids: torch.Tensor, cfg: GemmConfig, *, arrivals: torch.Tensor, h_scale: torch.Tensor | None = None,
             down_scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
             out: torch.Tensor | None = None, quantize: bool = False, accumulate: bool = False) -> torch.Tensor:
    """h [T * top_k, I] through down [E, H, I], each token's rows weighted by its routing weights
    (``topk_weights`` [T, top_k], any row stride) and summed over those whose expert id
    (``topk_ids``, the ids ``blocks`` were aligned from) is not -1 -> [T, H] in ``out_dtype`` (by
    default h's), or into ``out``; a token whose ids are all -1 is not written. ``arrivals`` as
    ``moe_gate_up`` left them. The rows pass through memory in the output's dtype, each GEMM's
    result rounded to it as native rounds it. ``quantize`` as in ``moe_gate_up``; ``accumulate``:
    add the sum to what ``out`` holds."""
    if accumulate and out is None:
        raise ValueError("accumulating needs the output to add to")
    if topk_weights.dim() != 2 or topk_weights.numel() != blocks.num_assignments:
        raise ValueError(f"routing weights {list(topk_weights.shape)} are not [tokens, top_k] of "
                         f"{blocks.num_assignments} assignments")
    if topk_ids.shape != topk_weights.shape:
        raise ValueError(f"expert ids {list(topk_ids.shape)} do not fit routing weights {list(topk_weights.shape)}")
    h, down = unit_inner_stride(h, down)
    num_tokens, hidden = topk_weights.shape[0], down.shape[1]
    _check_arrivals(arrivals, num_tokens, hidden, cfg)
    out = output_for(num_tokens, hidden, out_dtype or h.dtype, h.device, out)
    rows = torch.empty(blocks.num_assignments, hidden, dtype=out.dtype, device=h.device)
    weights = topk_weights.float()
    _grouped_gemm(h, h_scale, down, down_scale, blocks, cfg, hidden, 1, rows, arrivals, gated=False, out=out,
                  topk_weights=weights if weights.stride(1) == 1 else weights.contiguous(),
                  topk_ids=topk_ids if topk_ids.stride(1) == 1 else topk_ids.contiguous(), quantize_a=quantize,
                  accumulate=accumulate)
    return out


def fused_moe(x: torch.Tensor, topk_weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
              down: torch.Tensor, *, activation: str = "silu", swiglu_limit: float | None = None,
              gate_up_scale: torch.Tensor | None = None, down_scale: torch.Tensor | None = None,
              out: torch.Tensor | None = None, scaled_mma: bool | None = None,
              config: GemmConfig | None = None, blocks: ExpertBlocks | None = None,
              quantize_in_gemm: bool | None = None, accumulate: bool = False) -> torch.Tensor:
    """x [T, H], routing weights and expert ids [T, top_k], gate_up [E, 2I, H], down [E, H, I]
    -> the weighted sum over each token's experts [T, H] in x's dtype, or written into ``out``.
    The weights and ids may be column slices of a wider routing: they are read through their row
    stride, not copied. An id -1 names no expert and adds nothing; a token whose ids are all -1 is
    not written (its row of ``out`` stays as it was).

    FP8 weights come with ``gate_up_scale`` [E, ceil(2I/B), ceil(H/B)] and ``down_scale``
    [E, ceil(H/B), ceil(I/B)] (B = 128 or 32); x and the SwiGLU output are then quantized per token
    and B channels on the way into each GEMM. FP4 weights (packed uint8, gate_up [E, 2I, H/2] and down
    [E, H, I/2]) come with uint8 E8M0 scales [E, N, K/32]; where the target has a block-scaled MMA
    (``scaled_mma``, by default from ``FP4_SCALED_MMA``) the activations are quantized to MXFP8 for
    it, elsewhere the weights are dequantized in registers and meet x as it is. ``config``: the launch
    parameters of both GEMMs instead of the tuning table's (a sweep's candidates). ``blocks``: the
    ids aligned by expert already (``moe_dispatch.route_and_align``), in blocks of the config's rows.
    ``quantize_in_gemm``: whether the GEMMs quantize their FP8 or MXFP8 activations as they load
    them instead of a launch before each (by default for a decode step's rows, ``quantizes_in_gemm``).
    ``accumulate``: add the sum to what ``out`` holds (another stack's experts of the same tokens).
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"expert activation {activation!r} is not supported; supported: {sorted(ACTIVATIONS)}")
    num_tokens, top_k = ids.shape
    packing = 2 if gate_up.dtype == PACKED_FP4 else 1
    num_experts, two_inner, hidden = gate_up.shape[0], gate_up.shape[1], gate_up.shape[2] * packing
    if (x.shape != (num_tokens, hidden) or topk_weights.shape != ids.shape
            or down.shape != (num_experts, hidden, two_inner // 2 // packing)):
        raise ValueError(f"x {list(x.shape)}, weights {list(topk_weights.shape)}, ids {list(ids.shape)}, gate_up "
                         f"{list(gate_up.shape)} and down {list(down.shape)} do not fit together")
    if accumulate and out is None:
        raise ValueError("accumulating needs the output to add to")
    out = output_for(num_tokens, hidden, x.dtype, x.device, out)
    if num_tokens == 0:
        return out
    block = fp8_expert_block(gate_up, gate_up_scale)
    if block is not None and fp8_expert_block(down, down_scale) != block:
        raise ValueError(f"gate_up scales {list(gate_up_scale.shape)} and down scales {list(down_scale.shape)} "
                         f"are not of one block edge")
    cfg = config or moe_config(num_tokens, top_k, num_experts, x.device, fp4=packing == 2, fp8_block=block or GROUP)
    if blocks is None:
        blocks = align_by_expert(ids, num_experts, cfg.block_m)
    quantize = None
    if block is not None:
        quantize = partial(quantize_fp8_token_group, group=block)
    elif packing == 2 and (config_for(FP4_SCALED_MMA, x.device) if scaled_mma is None else scaled_mma):
        quantize = quantize_mxfp8
    if quantize_in_gemm is None:
        quantize_in_gemm = quantize is not None and quantizes_in_gemm(cfg, num_tokens, top_k, num_experts, x.device,
                                                                      fp8_block=block)
    in_gemm = quantize is not None and quantize_in_gemm
    a, x_scale = quantize(x) if quantize and not in_gemm else (x, None)
    arrivals = arrivals_for(num_tokens, hidden, cfg, x.device)
    h = moe_gate_up(a, blocks, gate_up, top_k, cfg, arrivals=arrivals, swiglu_limit=swiglu_limit, x_scale=x_scale,
                    gate_up_scale=gate_up_scale, out_dtype=x.dtype, quantize=in_gemm)
    h, h_scale = quantize(h) if quantize and not in_gemm else (h, None)
    return moe_down(h, blocks, down, topk_weights, ids, cfg, arrivals=arrivals, h_scale=h_scale,
                    down_scale=down_scale, out=out, quantize=in_gemm, accumulate=accumulate)


def quantizes_in_gemm(cfg: GemmConfig, num_tokens: int, top_k: int, num_experts: int, device: torch.device, *,
                      fp8_block: int | None) -> bool:
    """Whether the grouped GEMMs quantize their activations as they load them: for decode-sized rows
    per expert, where the weights' bytes bound the time and a program's extra work on its few rows
    hides behind them (a prefill's programs would each quantize many rows again, once per column
    tile: there one launch quantizes them once), and, for FP8 in blocks of ``fp8_block`` (None: FP4),
    K steps of exactly one block."""
    tuning = config_for(MOE_TUNING[fp8_block] if fp8_block else MOE_FP4_GEMM, device)
    decode = -(-num_tokens * top_k // num_experts) <= tuning.small_m
    return decode and (cfg.block_k == fp8_block if fp8_block else cfg.block_k % MX_BLOCK == 0)
