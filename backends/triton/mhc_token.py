"""The per-token half of DeepSeek-V4's hyper-connection mixes (mHC): from a token's split-K partials
(mhc_partials.py), its gates, its comb by Sinkhorn-Knopp and the collapse of its streams, with or
without the RMSNorm after it. mhc.py's per-token kernels run these a token a program; the boundary
kernel (mhc_boundary.py) runs them for each token of its block in the program that arrives last.

The partials are summed over the splits in a fixed order (all loaded at once and reduced as one
tree), so the result does not depend on which program wrote them when.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _summed(ptrs, mask):
    """Partials laid out [split, ...] summed over the leading split axis: all splits are loaded at
    once and reduced as one tree in a fixed order."""
    return tl.sum(tl.load(ptrs, mask=mask, other=0.0), axis=0)


@triton.jit
def _rstd(ss_ptr, t, T, K, eps, splits, SPLITS: tl.constexpr):
    rs = tl.arange(0, SPLITS)
    return 1.0 / tl.sqrt(_summed(ss_ptr + rs * T + t, rs < splits) / K + eps)


@triton.jit
def _collapsed(streams_ptr, pre, t, D, rd, stride_st, stride_si, N: tl.constexpr, NP: tl.constexpr):
    """sum_i pre_i * streams[t, i, rd] in fp32 (pre is 0 past N)."""
    ri = tl.arange(0, NP)
    s = tl.load(streams_ptr + t * stride_st + ri[:, None] * stride_si + rd[None, :],
                mask=(ri[:, None] < N) & (rd[None, :] < D), other=0.0)
    return tl.sum(pre[:, None] * s.to(tl.float32), axis=0)


@triton.jit
def _collapse(streams_ptr, out_ptr, norm_ptr, pre, t, block, D, stride_st, stride_si, stride_ot, eps,
              N: tl.constexpr, NP: tl.constexpr, BLOCK_D: tl.constexpr, NORM: tl.constexpr,
              ROUND_BEFORE_WEIGHT: tl.constexpr):
    """out[t] = sum_i pre_i * streams[t, i] in fp32, rounded once to out's dtype: over ``block`` of D
    (``block`` < 0: every block); with NORM the whole row, through the RMSNorm of weight
    ``norm_ptr``: its sum of squares over one pass, then the row again, normalised and rounded as
    backends/triton/norm.py's kernel rounds the rounded collapse."""
    ty = out_ptr.dtype.element_ty
    rd0 = tl.arange(0, BLOCK_D)
    if NORM:
        ss = tl.zeros((BLOCK_D,), dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            h = _collapsed(streams_ptr, pre, t, D, d0 + rd0, stride_st, stride_si, N, NP).to(ty).to(tl.float32)
            ss += h * h
        scale = tl.rsqrt(tl.sum(ss, axis=0) / D + eps)
        for d0 in range(0, D, BLOCK_D):
            rd = d0 + rd0
            h = _collapsed(streams_ptr, pre, t, D, rd, stride_st, stride_si, N, NP).to(ty).to(tl.float32) * scale
            if ROUND_BEFORE_WEIGHT:
                h = h.to(ty).to(tl.float32)
            h = tl.load(norm_ptr + rd, mask=rd < D, other=0.0).to(tl.float32) * h
            tl.store(out_ptr + t * stride_ot + rd, h.to(ty), mask=rd < D)
    else:
        first = tl.maximum(block, 0) * BLOCK_D
        for d0 in range(first, tl.where(block < 0, D, first + 1), BLOCK_D):
            rd = d0 + rd0
            out = _collapsed(streams_ptr, pre, t, D, rd, stride_st, stride_si, N, NP)
            tl.store(out_ptr + t * stride_ot + rd, out.to(ty), mask=rd < D)


@triton.jit
def _sinkhorn(logits, valid, iters, eps):
    """Row softmax + eps, a column normalisation, then ``iters - 1`` row and column rounds, as
    core/native/mhc.py's ``sinkhorn``; entries outside ``valid`` stay 0."""
    logits = tl.where(valid, logits, -1e30)
    e = tl.where(valid, tl.exp(logits - tl.max(logits, axis=1)[:, None]), 0.0)
    # a row's sum is at least exp(0) = 1; the floor only spares the padding rows a 0 / 0
    comb = tl.where(valid, e / tl.maximum(tl.sum(e, axis=1), 1.0)[:, None] + eps, 0.0)
    comb = comb / (tl.sum(comb, axis=0)[None, :] + eps)
    for _ in range(iters - 1):
        comb = comb / (tl.sum(comb, axis=1)[:, None] + eps)
        comb = comb / (tl.sum(comb, axis=0)[None, :] + eps)
    return comb


@triton.jit
def pre_token(mix_ptr, ss_ptr, base_ptr, scale_ptr, streams_ptr, out_ptr, post_ptr, comb_ptr, norm_ptr, t, block,
              T, D, splits, stride_st, stride_si, stride_ot, norm_eps, hc_eps, iters, eps,
              N: tl.constexpr, NP: tl.constexpr, MP: tl.constexpr, SPLITS: tl.constexpr, BLOCK_D: tl.constexpr,
              NORM: tl.constexpr, ROUND_BEFORE_WEIGHT: tl.constexpr):
    """Token ``t`` of a sublayer's pre: gates and comb from the summed partials, and the collapse of
    ``block`` of D (< 0: all of it; with NORM: the row, normalised); with ``block`` <= 0 also its
    post [T, N] and comb [T, N, N]."""
    ri = tl.arange(0, NP)
    rj = tl.arange(0, NP)
    row = ri < N
    valid = row[:, None] & (rj[None, :] < N)
    cells = 2 * N + ri[:, None] * N + rj[None, :]
    rs = tl.arange(0, SPLITS)
    live = rs < splits
    parts = mix_ptr + (rs * T + t) * MP  # token t's partials in each split
    rstd = _rstd(ss_ptr, t, T, N * D, norm_eps, splits, SPLITS)
    pre_s = tl.load(scale_ptr)
    post_s = tl.load(scale_ptr + 1)
    comb_s = tl.load(scale_ptr + 2)
    pre_w = _summed(parts[:, None] + ri[None, :], live[:, None] & row[None, :]) * rstd
    post_w = _summed(parts[:, None] + N + ri[None, :], live[:, None] & row[None, :]) * rstd
    comb_w = _summed(parts[:, None, None] + cells[None, :, :], live[:, None, None] & valid[None, :, :]) * rstd
    pre = tl.sigmoid(pre_w * pre_s + tl.load(base_ptr + ri, mask=row, other=0.0)) + hc_eps
    pre = tl.where(row, pre, 0.0)
    _collapse(streams_ptr, out_ptr, norm_ptr, pre, t, block, D, stride_st, stride_si, stride_ot, eps, N, NP, BLOCK_D,
              NORM, ROUND_BEFORE_WEIGHT)
    if block <= 0:
        post = 2 * tl.sigmoid(post_w * post_s + tl.load(base_ptr + N + ri, mask=row, other=0.0))
        tl.store(post_ptr + t * N + ri, post, mask=row)
        logits = comb_w * comb_s + tl.load(base_ptr + cells, mask=valid, other=0.0)
        comb = _sinkhorn(logits, valid, iters, hc_eps)
        tl.store(comb_ptr + t * N * N + ri[:, None] * N + rj[None, :], comb, mask=valid)


@triton.jit
def head_token(mix_ptr, ss_ptr, base_ptr, scale_ptr, streams_ptr, out_ptr, norm_ptr, t, block,
               T, D, splits, stride_st, stride_si, stride_ot, norm_eps, hc_eps, eps,
               N: tl.constexpr, NP: tl.constexpr, MP: tl.constexpr, SPLITS: tl.constexpr, BLOCK_D: tl.constexpr,
               NORM: tl.constexpr, ROUND_BEFORE_WEIGHT: tl.constexpr):
    """Token ``t`` of the head: sigmoid weights from the summed partials, and the collapse of
    ``block`` of D (< 0: all of it; with NORM: the row, normalised)."""
    ri = tl.arange(0, NP)
    row = ri < N
    rs = tl.arange(0, SPLITS)
    mix = _summed(mix_ptr + (rs[:, None] * T + t) * MP + ri[None, :], (rs[:, None] < splits) & row[None, :])
    mix = mix * _rstd(ss_ptr, t, T, N * D, norm_eps, splits, SPLITS)
    pre = tl.sigmoid(mix * tl.load(scale_ptr) + tl.load(base_ptr + ri, mask=row, other=0.0)) + hc_eps
    _collapse(streams_ptr, out_ptr, norm_ptr, tl.where(row, pre, 0.0), t, block, D, stride_st, stride_si, stride_ot,
              eps, N, NP, BLOCK_D, NORM, ROUND_BEFORE_WEIGHT)
