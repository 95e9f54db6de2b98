"""DeepSeek-V4's hyper-connection mixes (mHC) in three kernels, batched over the step's tokens.

``pre`` and ``head`` project each token's RMS-normalised n * D streams to a few mixing weights (a
GEMM with K = n * D, 16384 at V4-Flash, and N = (2 + n) * n = 24 or n). Normalising before a
linear map equals scaling the product by 1 / rms, so one pass over the streams yields both the
raw product and the sum of squares: split along K over many programs, each writes fp32 partials,
and a per-token kernel sums them in a fixed order (deterministic, no atomics), applies the
scale, bias and gates, runs Sinkhorn-Knopp on the n x n comb in registers and writes the
collapse sum_i pre_i * streams_i. ``post`` is one launch: post_i * block_out + comb^T streams.

Rounding follows core/native/mhc.py: the mixes, gates and comb are fp32; the collapse is an fp32
sum rounded once to the streams' dtype; ``post`` rounds post and comb to the streams' dtype and
the two products to it before their sum, as the oracle's ops in that dtype do. With 16-bit streams
the fp32 weight is split into two 16-bit parts (hi + lo, 16 mantissa bits together) so that the
product runs on the tensor cores at nearly fp32 accuracy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.core.families.mhc import MHCBackend, MixWeights

from .descriptors import MHC_MAX_STREAMS as MAX_STREAMS
from .pdl import launch_options, wait_for_prior
from .target import config_for


@dataclass(frozen=True)
class MixConfig:
    block_t: int  # tokens per program of the product (16 where there are at most 16)
    block_k: int  # streams' elements per step along K
    programs: int  # the product's grid aims at this many programs (tokens x splits of K)
    num_warps: int
    num_stages: int
    block_d: int  # hidden elements per program of the collapse and of ``post``
    token_warps: int  # warps of the per-token kernels (gates, Sinkhorn-Knopp, collapse; post)


MIX = {  # cuda: the best of an H200 sweep of each field around these values at 1/32/128/4096 tokens; hip: guesses
    "cuda": MixConfig(block_t=64, block_k=128, programs=264, num_warps=4, num_stages=3, block_d=2048, token_warps=4),
    "hip": MixConfig(block_t=64, block_k=128, programs=608, num_warps=4, num_stages=2, block_d=1024, token_warps=4),
    "default": MixConfig(block_t=16, block_k=64, programs=4, num_warps=4, num_stages=1, block_d=128, token_warps=4),
}
SMALL_T = 16  # the smallest M of tl.dot


@triton.jit
def mix_partials_kernel(x_ptr, fn_ptr, mix_ptr, ss_ptr, T, M, K, k_per_split, stride_x, stride_fn,
                        BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, MP: tl.constexpr, PDL: tl.constexpr):
    """Split ``program_id(1)`` of K: x [T, K] @ fn [M, K].T -> mix [split, T, MP] and the sum of x^2
    -> ss [split, T], both fp32. Columns past M reread fn's last row; nothing reads them."""
    split = tl.program_id(1)
    rt = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    rows = tl.minimum(rt, T - 1).to(tl.int64)  # rows past T reread the last one; they are not stored
    rm = tl.minimum(tl.arange(0, MP), M - 1).to(tl.int64)
    rk0 = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_T, MP), dtype=tl.float32)
    ss = tl.zeros((BLOCK_T,), dtype=tl.float32)
    wait_for_prior(PDL)
    k_start = split * k_per_split
    for k0 in range(k_start, tl.minimum(k_start + k_per_split, K), BLOCK_K):
        rk = k0 + rk0
        x = tl.load(x_ptr + rows[:, None] * stride_x + rk[None, :], mask=rk[None, :] < K, other=0.0)
        w = tl.load(fn_ptr + rm[None, :] * stride_fn + rk[:, None], mask=rk[:, None] < K, other=0.0).to(tl.float32)
        xf = x.to(tl.float32)
        ss += tl.sum(xf * xf, axis=1)
        if x.dtype == tl.float32:
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:
            hi = w.to(x.dtype)
            acc = tl.dot(x, hi, acc)
            acc = tl.dot(x, (w - hi.to(tl.float32)).to(x.dtype), acc)
    at = (split * T + rt).to(tl.int64)
    keep = rt < T
    tl.store(mix_ptr + at[:, None] * MP + tl.arange(0, MP)[None, :], acc, mask=keep[:, None])
    tl.store(ss_ptr + at, ss, mask=keep)


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
def _collapse(streams_ptr, out_ptr, pre, t, D, stride_st, stride_si, stride_ot,
              N: tl.constexpr, NP: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[t, d] = sum_i pre_i * streams[t, i, d] over this program's block of d, in fp32, rounded once."""
    ri = tl.arange(0, NP)
    rd = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    s = tl.load(streams_ptr + t * stride_st + ri[:, None] * stride_si + rd[None, :],
                mask=(ri[:, None] < N) & (rd[None, :] < D), other=0.0)
    out = tl.sum(pre[:, None] * s.to(tl.float32), axis=0)
    tl.store(out_ptr + t * stride_ot + rd, out.to(out_ptr.dtype.element_ty), mask=rd < D)


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
def pre_mix_kernel(mix_ptr, ss_ptr, base_ptr, scale_ptr, streams_ptr, out_ptr, post_ptr, comb_ptr,
                   T, D, splits, stride_st, stride_si, stride_ot, norm_eps, hc_eps, iters,
                   N: tl.constexpr, NP: tl.constexpr, MP: tl.constexpr, SPLITS: tl.constexpr,
                   BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    """Token ``program_id(0)``: gates and comb from the summed partials, and the collapse of one
    block of D; the block-0 program also writes post [T, N] and comb [T, N, N]."""
    t = tl.program_id(0).to(tl.int64)
    ri = tl.arange(0, NP)
    rj = tl.arange(0, NP)
    row = ri < N
    valid = row[:, None] & (rj[None, :] < N)
    cells = 2 * N + ri[:, None] * N + rj[None, :]
    rs = tl.arange(0, SPLITS)
    live = rs < splits
    parts = mix_ptr + (rs * T + t) * MP  # token t's partials in each split
    wait_for_prior(PDL)
    rstd = _rstd(ss_ptr, t, T, N * D, norm_eps, splits, SPLITS)
    pre_s = tl.load(scale_ptr)
    post_s = tl.load(scale_ptr + 1)
    comb_s = tl.load(scale_ptr + 2)
    pre_w = _summed(parts[:, None] + ri[None, :], live[:, None] & row[None, :]) * rstd
    post_w = _summed(parts[:, None] + N + ri[None, :], live[:, None] & row[None, :]) * rstd
    comb_w = _summed(parts[:, None, None] + cells[None, :, :], live[:, None, None] & valid[None, :, :]) * rstd
    pre = tl.sigmoid(pre_w * pre_s + tl.load(base_ptr + ri, mask=row, other=0.0)) + hc_eps
    pre = tl.where(row, pre, 0.0)
    _collapse(streams_ptr, out_ptr, pre, t, D, stride_st, stride_si, stride_ot, N, NP, BLOCK_D)
    if tl.program_id(1) == 0:
        post = 2 * tl.sigmoid(post_w * post_s + tl.load(base_ptr + N + ri, mask=row, other=0.0))
        tl.store(post_ptr + t * N + ri, post, mask=row)
        logits = comb_w * comb_s + tl.load(base_ptr + cells, mask=valid, other=0.0)
        comb = _sinkhorn(logits, valid, iters, hc_eps)
        tl.store(comb_ptr + t * N * N + ri[:, None] * N + rj[None, :], comb, mask=valid)


@triton.jit
def head_mix_kernel(mix_ptr, ss_ptr, base_ptr, scale_ptr, streams_ptr, out_ptr,
                    T, D, splits, stride_st, stride_si, stride_ot, norm_eps, hc_eps,
                    N: tl.constexpr, NP: tl.constexpr, MP: tl.constexpr, SPLITS: tl.constexpr,
                    BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    """Token ``program_id(0)``: sigmoid weights from the summed partials, and the collapse of one block of D."""
    t = tl.program_id(0).to(tl.int64)
    ri = tl.arange(0, NP)
    row = ri < N
    rs = tl.arange(0, SPLITS)
    wait_for_prior(PDL)
    mix = _summed(mix_ptr + (rs[:, None] * T + t) * MP + ri[None, :], (rs[:, None] < splits) & row[None, :])
    mix = mix * _rstd(ss_ptr, t, T, N * D, norm_eps, splits, SPLITS)
    pre = tl.sigmoid(mix * tl.load(scale_ptr) + tl.load(base_ptr + ri, mask=row, other=0.0)) + hc_eps
    _collapse(streams_ptr, out_ptr, tl.where(row, pre, 0.0), t, D, stride_st, stride_si, stride_ot, N, NP, BLOCK_D)


@triton.jit
def post_mix_kernel(block_out_ptr, streams_ptr, post_ptr, comb_ptr, out_ptr, D,
                    stride_bt, stride_st, stride_si, stride_pt, stride_ct, stride_ot, stride_oi,
                    N: tl.constexpr, NP: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    """out[t, i, d] = post[t, i] * block_out[t, d] + sum_j comb[t, j, i] * streams[t, j, d], each
    product rounded to the streams' dtype before the sum, as core/native/mhc.py's ``hc_post``."""
    t = tl.program_id(0).to(tl.int64)
    ri = tl.arange(0, NP)
    rd = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    row, cols = ri < N, rd < D
    ty = out_ptr.dtype.element_ty
    wait_for_prior(PDL)
    post = tl.load(post_ptr + t * stride_pt + ri, mask=row, other=0.0).to(ty).to(tl.float32)
    x = tl.load(block_out_ptr + t * stride_bt + rd, mask=cols, other=0.0).to(tl.float32)
    mixed = tl.zeros((NP, BLOCK_D), dtype=tl.float32)
    for j in tl.static_range(N):
        col = tl.load(comb_ptr + t * stride_ct + j * N + ri, mask=row, other=0.0).to(ty).to(tl.float32)
        s = tl.load(streams_ptr + t * stride_st + j * stride_si + rd, mask=cols, other=0.0).to(tl.float32)
        mixed += col[:, None] * s[None, :]
    expanded = (post[:, None] * x[None, :]).to(ty).to(tl.float32)
    out = expanded + mixed.to(ty).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + ri[:, None] * stride_oi + rd[None, :], out.to(ty),
             mask=row[:, None] & cols[None, :])


def _empty(*shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every buffer the launches write (tests fill them with NaN first)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _check_streams(streams: torch.Tensor) -> torch.Tensor:
    if streams.dim() != 3:
        raise ValueError(f"streams must be [T, n, D], not {list(streams.shape)}")
    if not 1 <= streams.shape[1] <= MAX_STREAMS:
        raise ValueError(f"streams: n = {streams.shape[1]} streams; the kernels take 1 to {MAX_STREAMS}")
    return streams if streams.stride(2) == 1 and streams.stride(1) == streams.shape[2] else streams.contiguous()


def _check_weights(w: MixWeights, n: int, d: int, mixes: int, scales: int) -> None:
    for field, got, want in (("fn", w.fn.shape, (mixes, n * d)), ("base", w.base.shape, (mixes,)),
                             ("scale", w.scale.shape, (scales,))):
        if tuple(got) != want:
            raise ValueError(f"MixWeights.{field} is {list(got)}; streams [T, {n}, {d}] need {list(want)}")


def _mix_partials(streams: torch.Tensor, fn: torch.Tensor,
                  cfg: MixConfig) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """The split-K product of the flattened streams and fn: (mix partials, sums of squares, splits, MP)."""
    t, k = streams.shape[0], streams.shape[1] * streams.shape[2]
    fn = fn if fn.stride(1) == 1 else fn.contiguous()
    mp = max(SMALL_T, triton.next_power_of_2(fn.shape[0]))
    block_t = SMALL_T if t <= SMALL_T else cfg.block_t
    t_blocks, chunks = triton.cdiv(t, block_t), triton.cdiv(k, cfg.block_k)
    k_per_split = triton.cdiv(chunks, max(1, min(chunks, triton.cdiv(cfg.programs, t_blocks)))) * cfg.block_k
    splits = triton.cdiv(k, k_per_split)
    mix = _empty(splits, t, mp, dtype=torch.float32, device=streams.device)
    ss = _empty(splits, t, dtype=torch.float32, device=streams.device)
    mix_partials_kernel[(t_blocks, splits)](
        streams, fn, mix, ss, t, fn.shape[0], k, k_per_split, streams.stride(0), fn.stride(0),
        BLOCK_T=block_t, BLOCK_K=cfg.block_k, MP=mp, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **launch_options(streams.device))
    return mix, ss, splits, mp


def _collapse_launch(streams: torch.Tensor, cfg: MixConfig) -> tuple[torch.Tensor, tuple[int, int], dict]:
    t, n, d = streams.shape
    block_d = min(cfg.block_d, triton.next_power_of_2(d))
    out = _empty(t, d, dtype=streams.dtype, device=streams.device)
    shape = dict(N=n, NP=triton.next_power_of_2(n), BLOCK_D=block_d, num_warps=cfg.token_warps)
    return out, (t, triton.cdiv(d, block_d)), shape


def mhc_pre(streams: torch.Tensor, w: MixWeights) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``core.native.mhc.hc_pre`` in two launches: streams [T, n, D] -> (collapse [T, D], post [T, n],
    comb [T, n, n])."""
    streams = _check_streams(streams)
    t, n, d = streams.shape
    _check_weights(w, n, d, (2 + n) * n, 3)
    cfg = config_for(MIX, streams.device)
    post = _empty(t, n, dtype=torch.float32, device=streams.device)
    comb = _empty(t, n, n, dtype=torch.float32, device=streams.device)
    out, grid, shape = _collapse_launch(streams, cfg)
    if t:
        mix, ss, splits, mp = _mix_partials(streams, w.fn, cfg)
        pre_mix_kernel[grid](mix, ss, w.base.float(), w.scale.float(), streams, out, post, comb, t, d, splits,
                             streams.stride(0), streams.stride(1), out.stride(0), w.norm_eps, w.hc_eps,
                             w.sinkhorn_iters, MP=mp, SPLITS=triton.next_power_of_2(splits), **shape,
                             **launch_options(streams.device))
    return out, post, comb


def mhc_head(streams: torch.Tensor, w: MixWeights) -> torch.Tensor:
    """``core.native.mhc.hc_head`` in two launches: streams [T, n, D] -> [T, D]."""
    streams = _check_streams(streams)
    t, n, d = streams.shape
    _check_weights(w, n, d, n, 1)
    cfg = config_for(MIX, streams.device)
    out, grid, shape = _collapse_launch(streams, cfg)
    if t:
        mix, ss, splits, mp = _mix_partials(streams, w.fn, cfg)
        head_mix_kernel[grid](mix, ss, w.base.float(), w.scale.float(), streams, out, t, d, splits,
                              streams.stride(0), streams.stride(1), out.stride(0), w.norm_eps, w.hc_eps,
                              MP=mp, SPLITS=triton.next_power_of_2(splits), **shape,
                              **launch_options(streams.device))
    return out


def mhc_post(block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """``core.native.mhc.hc_post`` in one launch: new streams [T, n, D] in the streams' dtype."""
    streams = _check_streams(streams)
    t, n, d = streams.shape
    for field, got, want in (("block_out", block_out.shape, (t, d)), ("post", post.shape, (t, n)),
                             ("comb", comb.shape, (t, n, n))):
        if tuple(got) != want:
            raise ValueError(f"{field} is {list(got)}; streams {list(streams.shape)} need {list(want)}")
    block_out = block_out if block_out.stride(-1) == 1 else block_out.contiguous()
    post, comb = post.contiguous(), comb.contiguous()
    cfg = config_for(MIX, streams.device)
    out = _empty(t, n, d, dtype=streams.dtype, device=streams.device)
    block_d = min(cfg.block_d, triton.next_power_of_2(d))
    if t:
        post_mix_kernel[(t, triton.cdiv(d, block_d))](
            block_out, streams, post, comb, out, d, block_out.stride(0), streams.stride(0), streams.stride(1),
            post.stride(0), comb.stride(0), out.stride(0), out.stride(1),
            N=n, NP=triton.next_power_of_2(n), BLOCK_D=block_d, num_warps=cfg.token_warps,
            enable_fp_fusion=False,  # a fused multiply-add would skip the rounding of post * block_out
            **launch_options(streams.device))
    return out


class TritonMHC(MHCBackend):
    name = "triton"
    graph_safe = True  # shapes from the tensors' sizes only; grids depend on T alone

    def pre(self, streams: torch.Tensor, w: MixWeights) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return mhc_pre(streams, w)

    def post(self, block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor,
             comb: torch.Tensor) -> torch.Tensor:
        return mhc_post(block_out, streams, post, comb)

    def head(self, streams: torch.Tensor, w: MixWeights) -> torch.Tensor:
        return mhc_head(streams, w)
