"""Decode-sized dense GEMM (a few rows of x against a bf16/fp16 weight), and the same with SiLU-and-mul
fused on the output of a gate/up projection.

At batch 1 to 8 a linear layer reads its weight once and does almost no arithmetic, so it runs at
the speed of that read, which the library GEMMs do not reach on small weights (on an H200 a
Qwen3-0.6B layer's four projections ran at about a quarter of the copy bandwidth). Here each
program owns a band of BLOCK_N output columns, streams its rows of the weight along K in
BLOCK_K chunks and reuses every chunk for all rows of x, accumulating in fp32 without tensor
cores. The fused variant reads the gate row and the up row of each column and writes
silu(gate) * up, so the [M, 2I] product never reaches memory; it rounds gate and up to the
output dtype first, as the separate GEMM and activation kernels do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .fp8_gemm import output_for, unit_inner_stride
from .target import config_for

MAX_ROWS = 8  # past this, x's rows are better served by the tensor-core GEMMs


@dataclass(frozen=True)
class GemvConfig:
    block_n: int  # output columns per program
    block_k: int  # weight columns per step
    num_warps: int
    num_stages: int


GEMV = {
    "cuda": GemvConfig(16, 512, 4, 3),
    "hip": GemvConfig(16, 512, 4, 2),
    "default": GemvConfig(8, 64, 4, 1),
}


@triton.jit
def _band_product(x_ptr, w_rows, M, K, stride_xm, rk0,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """x [M, K] times the BLOCK_N weight rows at ``w_rows`` -> fp32 [BLOCK_M, BLOCK_N]."""
    rm = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + rk0
        if EVEN_K:
            w = tl.load(w_rows + rk[None, :]).to(tl.float32)
        else:
            w = tl.load(w_rows + rk[None, :], mask=rk[None, :] < K, other=0.0).to(tl.float32)
        for m in tl.static_range(BLOCK_M):
            row = tl.minimum(m, M - 1)  # rows past M reread the last one; they are not stored
            x = tl.load(x_ptr + row * stride_xm + rk, mask=rk < K, other=0.0).to(tl.float32)
            acc += tl.where(rm[:, None] == m, tl.sum(w * x[None, :], axis=1)[None, :], 0.0)
    return acc


@triton.jit
def gemv_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, EVEN_K: tl.constexpr):
    """out [M, N] = x @ w.T (+ bias); with SILU_MUL, w holds N gate rows then N up rows and
    out = silu(x @ gate.T) * (x @ up.T)."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = (rn % N).to(tl.int64)  # columns past N reread row N-1; they are not stored
    rk0 = tl.arange(0, BLOCK_K)
    acc = _band_product(x_ptr, w_ptr + rows[:, None] * stride_wn, M, K, stride_xm, rk0,
                        BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K)
    out_ty = out_ptr.dtype.element_ty
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    if SILU_MUL:
        up = _band_product(x_ptr, w_ptr + (rows + N)[:, None] * stride_wn, M, K, stride_xm, rk0,
                           BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K)
        gate = acc.to(out_ty).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(out_ty).to(tl.float32)
        acc = act * up.to(out_ty).to(tl.float32)
    rm = tl.arange(0, BLOCK_M)
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the GEMV serves this product: few rows of x, a plain float weight."""
    return x.numel() // max(1, x.shape[-1]) <= MAX_ROWS and weight.dtype in (torch.bfloat16, torch.float16,
                                                                              torch.float32)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, silu_mul: bool = False,
         config: GemvConfig | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (at most MAX_ROWS rows) @ weight [N, K].T (+ bias) -> [..., N] in x's dtype; with
    ``silu_mul`` weight is a gate/up projection [2I, K] and the result silu(gate) * up [..., I].
    ``config`` overrides the tuning table (the tuning sweep passes each candidate)."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    m, n = x2.shape[0], weight.shape[0] // (2 if silu_mul else 1)
    if m > MAX_ROWS or weight.shape[1] != k:
        raise ValueError(f"gemv takes at most {MAX_ROWS} rows of x and a weight [N, {k}], not x "
                         f"{list(x.shape)} and weight {list(weight.shape)}")
    if silu_mul and (weight.shape[0] % 2 or bias is not None):
        raise ValueError("a gate/up projection has an even number of rows and no bias")
    x2, weight = unit_inner_stride(x2, weight)
    out2 = output_for(m, n, x.dtype, x.device, None if out is None else out.view(m, n))
    if m and n:
        cfg = config or config_for(GEMV, x.device)
        gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
            x2, weight, bias, out2, m, n, k, x2.stride(0), weight.stride(0), out2.stride(0),
            BLOCK_M=triton.next_power_of_2(m), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            HAS_BIAS=bias is not None, SILU_MUL=silu_mul, EVEN_K=k % cfg.block_k == 0,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out2.view(*x.shape[:-1], n)
