"""Decode-sized dense GEMM (a few rows of x against a bf16/fp16 weight), and the same with SiLU-and-mul
fused on the output of a gate/up projection.

At batch 1 to 8 a linear layer reads its weight once and does almost no arithmetic, so it runs at
the speed of that read, which the library GEMMs do not reach on small weights (on an H200 a
Qwen3-0.6B layer's four projections ran at about a quarter of the copy bandwidth). Here each
program owns a band of BLOCK_N output columns and streams its rows of the weight along K in
BLOCK_K chunks, accumulating in fp32. One row of x is a multiply and a sum on the CUDA cores;
more rows go through ``tl.dot`` with x padded to 16 rows, since on the CUDA cores the arithmetic
of eight rows costs more than the read. The fused variant reads the gate row and the up row of each column and writes
silu(gate) * up, so the [M, 2I] product never reaches memory; it rounds gate and up to the
output dtype first, as the separate GEMM and activation kernels do.

A block-FP8 weight (E4M3 with one fp32 scale per B x B block, B 128 or 32: ``SCALE_BLOCK``) streams
through the same kernel as E4M3, half the bytes of bf16: each K step's tile is viewed as its runs of
B columns, each run multiplied by its block's scale in registers and rounded to x's dtype, the
weight core/native's linear dequantizes and multiplies by unquantized x. So decode rows of an FP8
model take one launch where the FP8 GEMM takes two (quantize x, then 64-row tiles for a few rows).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from engine.core.families.linear import fp8_block_edge

from .fp8_gemm import output_for, unit_inner_stride
from .pdl import launch_options, wait_for_prior
from .target import config_for

MAX_ROWS = 8  # past this, x's rows are better served by the tensor-core GEMMs
# Past this K the fused norm's rereads of x in every program cost more than the norm's own launch:
# on an H200 a Llama-8B step (K 4096) took 0.46 ms longer on the GPU with it, a Qwen3-0.6B step
# (K 1024) 0.06 ms shorter (benchmarks/decode_breakdown.py).
NORM_MAX_K = 2048


@dataclass(frozen=True)
class GemvConfig:
    block_n: int  # output columns per program
    block_k: int  # weight columns per step
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class GemvTuning:
    one_row: GemvConfig  # the CUDA-core product
    one_row_long_k: GemvConfig  # the same from LONG_K on: longer K steps, more warps in flight
    rows: GemvConfig  # the tl.dot product: block_n at least 16

    def for_shape(self, m: int, k: int, scale_block: int = 0, itemsize: int = 2) -> GemvConfig:
        """The config for ``m`` rows of x (``itemsize`` bytes a value) against K ``k``. Rows at two stages
        at most: of E4M3 with a scale every 32 columns (three spill on sm_90), and of 4-byte x (at
        three, fp32 rows with the fused norm took 292 KiB of shared memory on sm_90, over the 227
        a block may take)."""
        if m > 1:
            two = scale_block == 32 or itemsize > 2
            return replace(self.rows, num_stages=min(self.rows.num_stages, 2)) if two else self.rows
        return self.one_row_long_k if k >= LONG_K else self.one_row


LONG_K = 2048
G = GemvConfig
GEMV = {  # cuda: the best geometric means of the H200 sweep (benchmarks/results/gemv-h200.json); hip: guesses
    "cuda": GemvTuning(G(2, 1024, 4, 3), G(2, 2048, 8, 3), G(32, 512, 4, 3)),
    "hip": GemvTuning(G(4, 1024, 4, 1), G(4, 1024, 4, 1), G(16, 256, 4, 2)),
    "default": GemvTuning(G(8, 64, 4, 1), G(8, 64, 4, 1), G(16, 64, 4, 1)),
}
DOT_ROWS = 16  # the smallest M of tl.dot


@triton.jit
def _load_x(x_ptr, res_ptr, rm, rk, K, stride_xm, stride_rm, HAS_RESIDUAL: tl.constexpr, EVEN_K: tl.constexpr):
    """Rows ``rm`` of x at columns ``rk``, plus the residual's where there is one: the sum rounded to
    x's dtype, as the separate add rounds it."""
    if EVEN_K:
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :])
    else:
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=rk[None, :] < K, other=0.0)
    if HAS_RESIDUAL:
        if EVEN_K:
            r = tl.load(res_ptr + rm[:, None] * stride_rm + rk[None, :])
        else:
            r = tl.load(res_ptr + rm[:, None] * stride_rm + rk[None, :], mask=rk[None, :] < K, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
    return x


@triton.jit
def _row_rstd(x_ptr, res_ptr, res_out_ptr, M, K, stride_xm, stride_rm, stride_rom, eps, rk0,
              BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, HAS_RESIDUAL: tl.constexpr, EVEN_K: tl.constexpr):
    """1 / rms of each row of x (+ residual), fp32 [BLOCK_M]. Every program reads the whole rows (a
    few KB, from L1 after the first); program 0 also writes their sum, the next residual."""
    rows = tl.arange(0, BLOCK_M)
    rm = tl.minimum(rows, M - 1)
    keep = rows[:, None] < tl.where(tl.program_id(0) == 0, M, 0)  # the rows program 0 writes
    ss = tl.zeros([BLOCK_M], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + rk0
        s = _load_x(x_ptr, res_ptr, rm, rk, K, stride_xm, stride_rm, HAS_RESIDUAL, EVEN_K)
        if HAS_RESIDUAL:
            tl.store(res_out_ptr + rm[:, None] * stride_rom + rk[None, :], s, mask=keep & (rk[None, :] < K))
        sf = s.to(tl.float32)
        ss += tl.sum(sf * sf, axis=1)
    return tl.rsqrt(ss / K + eps)


@triton.jit
def _block_scaled(w, scale_rows, k0, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_BLOCK: tl.constexpr,
                  EVEN_K: tl.constexpr, run_stride=1):
    """An E4M3 tile [BLOCK_N, BLOCK_K] of weight columns from ``k0`` times its blocks' scales (the
    scale rows of its weight rows at ``scale_rows``) -> fp32, as core/native dequantizes it: the
    tile is viewed as runs of at most SCALE_BLOCK columns, one scale each, so a scale is loaded
    once a run and broadcast in registers. ``run_stride``: between the scales of consecutive
    blocks along K (a tile of the weight's transpose, low_rank_output.py's, steps scale rows)."""
    RUN: tl.constexpr = BLOCK_K if BLOCK_K < SCALE_BLOCK else SCALE_BLOCK
    RUNS: tl.constexpr = BLOCK_K // RUN
    starts = k0 + tl.arange(0, RUNS) * RUN
    scale_ptrs = scale_rows[:, None] + (starts // SCALE_BLOCK)[None, :] * run_stride
    if EVEN_K:
        s = tl.load(scale_ptrs)
    else:
        s = tl.load(scale_ptrs, mask=starts[None, :] < K, other=0.0)
    w = tl.reshape(w.to(tl.float32), (BLOCK_N, RUNS, RUN)) * s[:, :, None]
    return tl.reshape(w, (BLOCK_N, BLOCK_K))


@triton.jit
def _scale_rows(scale_ptr, rows, stride_s, SCALE_BLOCK: tl.constexpr):
    """The scale rows of weight ``rows`` (blocks of SCALE_BLOCK rows); for a plain weight, whose
    ``scale_ptr`` is None, something unread that is not None (a compiled jit function cannot
    return None; the interpreter can)."""
    held = rows
    if SCALE_BLOCK:
        held = scale_ptr + (rows // SCALE_BLOCK) * stride_s
    return held


@triton.jit
def _band_product(x_ptr, res_ptr, norm_ptr, rstd, w_rows, scale_rows, M, K, stride_xm, stride_rm, rk0,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                  NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, ROUND_BEFORE_WEIGHT: tl.constexpr,
                  SCALE_BLOCK: tl.constexpr):
    """x [M, K] (with NORM: rms_norm(x + residual), rounded as backends/triton/norm.py rounds it)
    times the BLOCK_N weight rows at ``w_rows`` (with SCALE_BLOCK, E4M3 scaled by the blocks at
    ``scale_rows`` and rounded to x's dtype) -> fp32 [BLOCK_M, BLOCK_N]; BLOCK_M is 1 (CUDA cores)
    or DOT_ROWS (tl.dot)."""
    rm = tl.minimum(tl.arange(0, BLOCK_M), M - 1)  # rows past M reread the last one; they are not stored
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + rk0
        wk = rk
        if SCALE_BLOCK and BLOCK_M == 1:
            # E4M3 in 8-byte loads, 8 a thread as x's 16-byte loads hold: the product then needs
            # no layout change of the tile (with 16 a thread, 8 KB through shared memory a K step)
            wk = tl.max_contiguous(k0 + rk0, 8)
        if EVEN_K:
            w = tl.load(w_rows + wk[None, :])
        else:
            w = tl.load(w_rows + wk[None, :], mask=wk[None, :] < K, other=0.0)
        x = _load_x(x_ptr, res_ptr, rm, rk, K, stride_xm, stride_rm, HAS_RESIDUAL, EVEN_K)
        if SCALE_BLOCK:
            w = _block_scaled(w, scale_rows, k0, K, BLOCK_N, BLOCK_K, SCALE_BLOCK, EVEN_K).to(x.dtype)
        if NORM:
            h = x.to(tl.float32) * rstd[:, None]
            if ROUND_BEFORE_WEIGHT:
                h = h.to(x.dtype).to(tl.float32)
            g = tl.load(norm_ptr + rk, mask=rk < K, other=0.0).to(tl.float32)
            x = (g[None, :] * h).to(x.dtype)
        if BLOCK_M == 1:
            acc += tl.sum(w.to(tl.float32) * x.to(tl.float32), axis=1)[None, :]
        elif w.dtype == tl.float32:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    return acc


@triton.jit
def gemv_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, res_ptr, res_out_ptr, norm_ptr, M, N, K,
                stride_xm, stride_wn, stride_sn, stride_om, stride_rm, stride_rom, eps,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, EVEN_K: tl.constexpr,
                NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, ROUND_BEFORE_WEIGHT: tl.constexpr,
                PDL: tl.constexpr, SCALE_BLOCK: tl.constexpr):
    """out [M, N] = x @ w.T (+ bias); with SILU_MUL, w holds N gate rows then N up rows and
    out = silu(x @ gate.T) * (x @ up.T). With NORM, x is first rms_norm(x + residual) with the
    weight at ``norm_ptr`` (HAS_RESIDUAL: the sum goes to ``res_out_ptr``), the decoder layer's
    input norm, so that it costs no launch of its own. SCALE_BLOCK (0: w is bf16/fp16/fp32): w is
    E4M3 with one fp32 scale per SCALE_BLOCK x SCALE_BLOCK block in ``scale_ptr`` (rows of
    ``stride_sn``)."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = (rn % N).to(tl.int64)  # columns past N reread row N-1; they are not stored
    up_rows = rows + N
    gate_scales = _scale_rows(scale_ptr, rows, stride_sn, SCALE_BLOCK)
    up_scales = _scale_rows(scale_ptr, up_rows, stride_sn, SCALE_BLOCK)
    rk0 = tl.arange(0, BLOCK_K)
    rstd = tl.zeros([BLOCK_M], tl.float32)
    wait_for_prior(PDL)
    if NORM:
        rstd = _row_rstd(x_ptr, res_ptr, res_out_ptr, M, K, stride_xm, stride_rm, stride_rom, eps, rk0,
                         BLOCK_M, BLOCK_K, HAS_RESIDUAL, EVEN_K)
    acc = _band_product(x_ptr, res_ptr, norm_ptr, rstd, w_ptr + rows[:, None] * stride_wn, gate_scales, M, K,
                        stride_xm, stride_rm, rk0, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, NORM, HAS_RESIDUAL,
                        ROUND_BEFORE_WEIGHT, SCALE_BLOCK)
    ty = x_ptr.dtype.element_ty  # the product's dtype; out_ptr's, or fp32 that holds its values (logits)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    if SILU_MUL:
        up = _band_product(x_ptr, res_ptr, norm_ptr, rstd, w_ptr + up_rows[:, None] * stride_wn, up_scales, M, K,
                           stride_xm, stride_rm, rk0, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, NORM, HAS_RESIDUAL,
                           ROUND_BEFORE_WEIGHT, SCALE_BLOCK)
        gate = acc.to(ty).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(ty).to(tl.float32)
        acc = act * up.to(ty).to(tl.float32)
    rm = tl.arange(0, BLOCK_M)
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(ty).to(out_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def norm_fits(x: torch.Tensor) -> bool:
    """Whether ``norm_gemv`` pays for its fused norm on rows as long as x's."""
    return x.shape[-1] <= NORM_MAX_K


def fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the GEMV serves this product: few rows of x, a plain float or an E4M3 weight."""
    return x.numel() // max(1, x.shape[-1]) <= MAX_ROWS and weight.dtype in WEIGHT_DTYPES


FLOATS = (torch.bfloat16, torch.float16, torch.float32)  # x's dtypes, and a float weight's
WEIGHT_DTYPES = (*FLOATS, torch.float8_e4m3fn)  # E4M3: with block scales


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, silu_mul: bool = False,
         config: GemvConfig | None = None, out: torch.Tensor | None = None,
         out_dtype: torch.dtype | None = None, scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (at most MAX_ROWS rows) @ weight [N, K].T (+ bias) -> [..., N] in x's dtype; with
    ``silu_mul`` weight is a gate/up projection [2I, K] and the result silu(gate) * up [..., I].
    ``out_dtype`` fp32: the same values (rounded to x's dtype) stored in fp32, as an LM head's
    logits go to the sampler. ``scale``: an E4M3 weight's fp32 block scales [ceil(N/B), ceil(K/B)],
    B 128 or 32. ``config`` overrides the tuning table (the tuning sweep passes each candidate)."""
    return _launch(x, weight, scale, bias, silu_mul, config, out, None, out_dtype or x.dtype)[0]


def norm_gemv(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
              weight: torch.Tensor, *, silu_mul: bool = False, config: GemvConfig | None = None,
              scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``gemv(rms_norm(x + residual), weight)`` and ``x + residual`` (residual None: x alone, and x
    is returned as the sum), in one launch."""
    if norm_weight.shape != (x.shape[-1],):
        raise ValueError(f"norm weight shape {tuple(norm_weight.shape)} does not match hidden size {x.shape[-1]}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} does not match x {tuple(x.shape)}")
    return _launch(x, weight, scale, None, silu_mul, config, None, (residual, norm_weight, eps), x.dtype)


def _scale_block(weight: torch.Tensor, scale: torch.Tensor | None) -> int:
    """The block edge of an E4M3 weight's scales (0 for a float weight, which takes none)."""
    if weight.dtype not in WEIGHT_DTYPES:
        raise ValueError(f"the gemv takes a weight in {WEIGHT_DTYPES}, not {weight.dtype}")
    if (weight.dtype == torch.float8_e4m3fn) != (scale is not None):
        raise ValueError(f"an E4M3 weight needs its block scales and a float one takes none: weight {weight.dtype}, "
                         f"scale {None if scale is None else list(scale.shape)}")
    return 0 if scale is None else fp8_block_edge(tuple(weight.shape), tuple(scale.shape))


def fused_scale_block(weight: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> int | None:
    """``SCALE_BLOCK`` of a weight that a launch fusing this GEMV with another product takes
    (gemv_chain.py, low_rank_output.py): 0 for one plain in x's ``dtype``, the block edge of an E4M3
    one with fp32 block scales; None for anything else, which the separate launches serve."""
    if weight.dim() != 2:
        return None
    try:
        block = _scale_block(weight, scale)
    except ValueError:
        return None
    return block if (scale.dtype == torch.float32 if block else weight.dtype == dtype) else None


def _launch(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None,
            silu_mul: bool, config: GemvConfig | None, out: torch.Tensor | None,
            norm: tuple[torch.Tensor | None, torch.Tensor, float] | None,
            out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    m, n = x2.shape[0], weight.shape[0] // (2 if silu_mul else 1)
    if m > MAX_ROWS or weight.shape[1] != k:
        raise ValueError(f"gemv takes at most {MAX_ROWS} rows of x and a weight [N, {k}], not x "
                         f"{list(x.shape)} and weight {list(weight.shape)}")
    if silu_mul and (weight.shape[0] % 2 or bias is not None):
        raise ValueError("a gate/up projection has an even number of rows and no bias")
    scale_block = _scale_block(weight, scale)
    x2, weight = unit_inner_stride(x2, weight)
    if scale is not None:
        scale = unit_inner_stride(scale)[0]
    out2 = output_for(m, n, out_dtype, x.device, None if out is None else out.view(m, n))
    residual, norm_weight, eps = norm or (None, None, 0.0)
    res2 = None if residual is None else unit_inner_stride(residual.reshape(-1, k))[0]
    summed = x2 if res2 is None else torch.empty_like(x2)
    if m and n:
        cfg = config or config_for(GEMV, x.device).for_shape(m, k, scale_block, x.element_size())
        gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
            x2, weight, scale, bias, out2, res2, summed, norm_weight, m, n, k,
            x2.stride(0), weight.stride(0), 0 if scale is None else scale.stride(0), out2.stride(0),
            0 if res2 is None else res2.stride(0), summed.stride(0), eps,
            BLOCK_M=1 if m == 1 else DOT_ROWS, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            HAS_BIAS=bias is not None, SILU_MUL=silu_mul, EVEN_K=k % cfg.block_k == 0,
            NORM=norm is not None, HAS_RESIDUAL=res2 is not None,
            ROUND_BEFORE_WEIGHT=norm is not None and norm_weight.dtype == x.dtype and x.dtype != torch.float32,
            SCALE_BLOCK=scale_block, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_options(x.device))
    return out2.view(*x.shape[:-1], n), summed.view(x.shape)
