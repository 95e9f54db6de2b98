"""Two decode GEMVs in one launch, the second fed by an RMSNorm of the first's leading columns:
DeepSeek-V4's attention input projections (the low-rank q beside the KV and the compressors') and
the query projections of the normed low-rank q (wq_b beside the indexer's), which a decode step ran
as two launches with nothing between them.

Programs take bands by ticket, from an atomic counter, as moe_one_launch.py takes its tiles: every
band of the first product, then every band of the second. A first band is gemv.py's (the same
product, rounded to x's dtype) and, if it covers any of the ``take`` columns the second reads,
counts itself into a flag (a barrier, then a release atomic at GPU scope). A second band waits until
the flag holds all of those bands (acquire), then runs gemv.py's norm prologue and product on
them. It never deadlocks: a waiting program waits only on bands with smaller tickets, taken by
programs already running, which never wait. The last program to finish (an arrival count) sets the
ticket, the flag and the count back to 0 for the next launch and every graph replay.

The bytes are the two launches' (each weight read once, the first's output from L2); the second
band's programs may become resident before the first product's last bands are in and spin there,
where the second launch would have waited for the first to drain. Numerics are the two launches':
the same bands, roundings and norm.

Either weight may be block-FP8 as DeepSeek publishes it (E4M3 with fp32 scales of 128 x 128 blocks,
V4.1's of 32 x 32: the low-rank q and KV are one FP8 group, the two query projections another),
each band then dequantized in registers by gemv.py's ``_band_product`` with that weight's
``SCALE_BLOCK``, as its own GEMV launch would: the FP8 checkpoint's decode takes the one launch too.
The other weight may stay plain in x's dtype (each weight's format is its own constexpr).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention_decode import arrival_counters
from .fp8_gemm import output_for, unit_inner_stride
from .gemv import (DOT_ROWS, FLOATS, GEMV, MAX_ROWS, NORM_MAX_K, GemvConfig, _band_product, _row_rstd,
                   _scale_rows, fused_scale_block)
from .pdl import launch_options, wait_for_prior
from .target import config_for


@triton.jit
def gemv_chain_kernel(x_ptr, w1_ptr, s1_ptr, out1_ptr, w2_ptr, s2_ptr, out2_ptr, norm_ptr, counters_ptr, M, N1, K1,
                      N2, K2, stride_xm, stride_w1, stride_s1, stride_o1, stride_w2, stride_s2, stride_o2, eps,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K1: tl.constexpr, BLOCK_K2: tl.constexpr,
                      EVEN_K1: tl.constexpr, EVEN_K2: tl.constexpr, ROUND_BEFORE_WEIGHT: tl.constexpr,
                      SCALE_BLOCK1: tl.constexpr, SCALE_BLOCK2: tl.constexpr, PDL: tl.constexpr):
    """out1 [M, N1] = x @ w1.T; out2 [M, N2] = rms_norm(out1[:, :K2], norm) @ w2.T. counters: the
    ticket, the flag, the arrival count, all zero at the start and left so. SCALE_BLOCK1/2 (0: that
    weight is in x's dtype): the weight is E4M3 with fp32 scales at s1/s2 (rows of stride_s1/s2)."""
    wait_for_prior(PDL)
    bands1 = tl.cdiv(N1, BLOCK_N)
    ready = tl.cdiv(K2, BLOCK_N)  # the first bands: those that hold the columns the second reads
    ticket = tl.atomic_add(counters_ptr, 1, sem="relaxed", scope="gpu")
    rm = tl.arange(0, BLOCK_M)
    ty = x_ptr.dtype.element_ty
    if ticket < bands1:
        rn = ticket * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = (rn % N1).to(tl.int64)  # columns past N1 reread row N1-1; they are not stored
        acc = _band_product(x_ptr, x_ptr, x_ptr, tl.zeros([BLOCK_M], tl.float32), w1_ptr + rows[:, None] * stride_w1,
                            _scale_rows(s1_ptr, rows, stride_s1, SCALE_BLOCK1), M, K1, stride_xm, 0,
                            tl.arange(0, BLOCK_K1), BLOCK_M, BLOCK_N, BLOCK_K1, EVEN_K1, False, False, False,
                            SCALE_BLOCK1)
        tl.store(out1_ptr + rm[:, None] * stride_o1 + rn[None, :], acc.to(ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < N1))
        if ticket < ready:
            tl.debug_barrier()  # every thread's stores before the release
            tl.atomic_add(counters_ptr + 1, 1, sem="release", scope="gpu")
    else:
        while tl.atomic_add(counters_ptr + 1, 0, sem="acquire", scope="gpu") < ready:
            pass
        rn = (ticket - bands1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = (rn % N2).to(tl.int64)
        rk = tl.arange(0, BLOCK_K2)
        rstd = _row_rstd(out1_ptr, out1_ptr, out1_ptr, M, K2, stride_o1, 0, 0, eps, rk, BLOCK_M, BLOCK_K2, False,
                         EVEN_K2)
        acc = _band_product(out1_ptr, out1_ptr, norm_ptr, rstd, w2_ptr + rows[:, None] * stride_w2,
                            _scale_rows(s2_ptr, rows, stride_s2, SCALE_BLOCK2), M, K2, stride_o1, 0, rk, BLOCK_M,
                            BLOCK_N, BLOCK_K2, EVEN_K2, True, False, ROUND_BEFORE_WEIGHT, SCALE_BLOCK2)
        tl.store(out2_ptr + rm[:, None] * stride_o2 + rn[None, :], acc.to(ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < N2))
    tl.debug_barrier()  # every thread done with the counters before the arrival
    if tl.atomic_add(counters_ptr + 2, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
        tl.store(counters_ptr, 0)
        tl.store(counters_ptr + 1, 0)
        tl.store(counters_ptr + 2, 0)


def fits(x: torch.Tensor, first: torch.Tensor, take: int, norm_weight: torch.Tensor, second: torch.Tensor,
         first_scale: torch.Tensor | None = None, second_scale: torch.Tensor | None = None) -> bool:
    """Whether the one launch serves these: a decode step's rows of x, each weight plain in x's dtype
    or block-FP8 (with its scale), the second reading at most ``gemv.NORM_MAX_K`` of the first's
    leading columns."""
    return (0 < x.numel() <= MAX_ROWS * x.shape[-1] and x.dtype in FLOATS
            and fused_scale_block(first, first_scale, x.dtype) is not None
            and fused_scale_block(second, second_scale, x.dtype) is not None
            and first.shape[1] == x.shape[-1] and 0 < take <= min(first.shape[0], NORM_MAX_K)
            and second.shape[1] == take and norm_weight.shape == (take,))


def gemv_chain(x: torch.Tensor, first: torch.Tensor, take: int, norm_weight: torch.Tensor, eps: float,
               second: torch.Tensor, first_scale: torch.Tensor | None = None,
               second_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(``gemv(x, first)``, ``norm_gemv(gemv(x, first)[..., :take], None, norm_weight, eps, second)``) in
    one launch; x [..., K] of at most ``gemv.MAX_ROWS`` rows, first [N1, K], second [N2, take], each
    in x's dtype or E4M3 with its fp32 block scales (``first_scale``, ``second_scale``)."""
    if not fits(x, first, take, norm_weight, second, first_scale, second_scale):
        raise ValueError(f"x {list(x.shape)} {x.dtype}, first {list(first.shape)} {first.dtype} (scale "
                         f"{_shape(first_scale)}), take {take}, norm {list(norm_weight.shape)} and second "
                         f"{list(second.shape)} {second.dtype} (scale {_shape(second_scale)}): not a decode step's "
                         f"rows against weights of x's dtype or block-FP8 ones with fp32 scales, the second reading "
                         f"the first's leading {take} (at most {NORM_MAX_K}) columns; run them apart")
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    m, n1, n2 = x2.shape[0], first.shape[0], second.shape[0]
    block1, block2 = fused_scale_block(first, first_scale, x.dtype), fused_scale_block(second, second_scale, x.dtype)
    x2, first, second = unit_inner_stride(x2, first, second)
    scale1 = first if first_scale is None else unit_inner_stride(first_scale)[0]  # unread where plain
    scale2 = second if second_scale is None else unit_inner_stride(second_scale)[0]
    out1 = output_for(m, n1, x.dtype, x.device, None)
    out2 = output_for(m, n2, x.dtype, x.device, None)
    tuning = config_for(GEMV, x.device)
    cfg1, cfg2 = tuning.for_shape(m, k, itemsize=x.element_size()), tuning.for_shape(m, take, itemsize=x.element_size())
    block_n = cfg1.block_n  # one band width for both: the one-row and the rows configs each share theirs
    gemv_chain_kernel[(triton.cdiv(n1, block_n) + triton.cdiv(n2, block_n),)](
        x2, first, scale1, out1, second, scale2, out2, norm_weight, arrival_counters(3, x.device), m, n1, k, n2,
        take, x2.stride(0), first.stride(0), scale1.stride(0), out1.stride(0), second.stride(0), scale2.stride(0),
        out2.stride(0), eps, BLOCK_M=1 if m == 1 else DOT_ROWS, BLOCK_N=block_n, BLOCK_K1=cfg1.block_k,
        BLOCK_K2=cfg2.block_k, EVEN_K1=k % cfg1.block_k == 0, EVEN_K2=take % cfg2.block_k == 0,
        ROUND_BEFORE_WEIGHT=norm_weight.dtype == x.dtype and x.dtype != torch.float32,
        SCALE_BLOCK1=block1, SCALE_BLOCK2=block2, **_launch_shape(cfg1, cfg2, block1 or block2),
        **launch_options(x.device))
    return out1.view(*x.shape[:-1], n1), out2.view(*x.shape[:-1], n2)


def _launch_shape(cfg1: GemvConfig, cfg2: GemvConfig, fp8: bool) -> dict[str, int]:
    """Warps and stages of the one launch: the two configs' larger warps and fewer stages; where a
    weight is block-FP8, its dequantized tiles and scales in registers too, 4 warps at most and no
    software pipelining (the AOT test's sm_100 build spilled a register at 8 warps, or at 2 or 3
    stages, depending on the rows and the block; not yet timed on a GPU). fp32 rows come at two
    stages (``GemvTuning.for_shape``): at three the rows' tiles of both products took 228 KiB of
    shared memory, over an H100's 227 (a drafter's fp32 decode graphs failed to capture, on an
    H100 at 49b16d5)."""
    if fp8:
        return dict(num_warps=min(cfg1.num_warps, cfg2.num_warps, 4), num_stages=1)
    return dict(num_warps=max(cfg1.num_warps, cfg2.num_warps), num_stages=min(cfg1.num_stages, cfg2.num_stages))


def _shape(scale: torch.Tensor | None) -> list[int] | None:
    return None if scale is None else list(scale.shape)
