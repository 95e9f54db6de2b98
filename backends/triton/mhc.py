"""DeepSeek-V4's hyper-connection mixes (mHC), batched over the step's tokens: the per-token kernels,
and the family's Triton backend.

``pre`` and ``head`` project each token's RMS-normalised n * D streams to a few mixing weights; the
product is split along K = n * D into fp32 partials (mhc_partials.py), and a per-token kernel sums
them in a fixed order (deterministic, no atomics), applies the scale, bias and gates, runs
Sinkhorn-Knopp on the n x n comb in registers and writes the collapse sum_i pre_i * streams_i.
``post`` (post_i * block_out + comb^T streams) is one launch, which at a sublayer boundary also
writes the next mix's partials. A boundary (a sublayer's post, the next one's pre and the RMSNorm
of its collapse, or the head and the final norm) is then two launches: that post, and the
per-token kernel, which with a norm takes a token's whole row in one program, collapsing it twice:
once for the sum of squares, once to write it normalised.

Rounding follows core/native/mhc.py: the mixes, gates and comb are fp32; the collapse is an fp32
sum rounded once to the streams' dtype, and normalised from that rounded value as
backends/triton/norm.py's kernel normalises it; ``post`` rounds post and comb to the streams' dtype
and the two products to it before their sum, as the oracle's ops in that dtype do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.core.families.mhc import MHCBackend, MixWeights
from engine.core.families.norm import NormBackend

from .descriptors import MHC_MAX_STREAMS as MAX_STREAMS
from .mhc_partials import Partials, ProductConfig, buffer, mix_partials, post_mix
from .pdl import launch_options, wait_for_prior
from .target import config_for


@dataclass(frozen=True)
class MixConfig:
    partials: ProductConfig  # mix_partials: a model's first pre, and pre and head alone
    post: ProductConfig  # post, which at a boundary writes the next mix's partials
    block_d: int  # hidden elements per program of the collapse (and per step of the one with a norm)
    token_warps: int  # warps of the per-token kernels (gates, Sinkhorn-Knopp, collapse)


# cuda partials: the best of an H200 sweep of each field around these values at 1/32/128/4096 tokens;
# cuda post: 32-token blocks and 2 stages, where the sm_90 code keeps the product in registers at 16
# and 32 tokens (3 stages spill at 16, 64 tokens at either), not yet timed; hip: guesses
MIX = {
    "cuda": MixConfig(ProductConfig(block_t=64, block_k=128, programs=264, num_warps=4, num_stages=3),
                      ProductConfig(block_t=32, block_k=128, programs=264, num_warps=4, num_stages=2),
                      block_d=2048, token_warps=4),
    "hip": MixConfig(ProductConfig(block_t=64, block_k=128, programs=608, num_warps=4, num_stages=2),
                     ProductConfig(block_t=32, block_k=128, programs=608, num_warps=4, num_stages=2),
                     block_d=1024, token_warps=4),
    "default": MixConfig(ProductConfig(block_t=16, block_k=64, programs=4, num_warps=4, num_stages=1),
                         ProductConfig(block_t=16, block_k=64, programs=4, num_warps=4, num_stages=1),
                         block_d=128, token_warps=4),
}


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
def _collapse(streams_ptr, out_ptr, norm_ptr, pre, t, D, stride_st, stride_si, stride_ot, eps,
              N: tl.constexpr, NP: tl.constexpr, BLOCK_D: tl.constexpr, NORM: tl.constexpr,
              ROUND_BEFORE_WEIGHT: tl.constexpr):
    """out[t] = sum_i pre_i * streams[t, i] in fp32, rounded once to out's dtype: over program_id(1)'s
    block of D; with NORM the whole row, through the RMSNorm of weight ``norm_ptr``: its sum of
    squares over one pass, then the row again, normalised and rounded as backends/triton/norm.py's
    kernel rounds the rounded collapse."""
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
        rd = tl.program_id(1) * BLOCK_D + rd0
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
def pre_mix_kernel(mix_ptr, ss_ptr, base_ptr, scale_ptr, streams_ptr, out_ptr, post_ptr, comb_ptr, norm_ptr,
                   T, D, splits, stride_st, stride_si, stride_ot, norm_eps, hc_eps, iters, eps,
                   N: tl.constexpr, NP: tl.constexpr, MP: tl.constexpr, SPLITS: tl.constexpr,
                   BLOCK_D: tl.constexpr, NORM: tl.constexpr, ROUND_BEFORE_WEIGHT: tl.constexpr,
                   PDL: tl.constexpr):
    """Token ``program_id(0)``: gates and comb from the summed partials, and the collapse of one
    block of D (with NORM: of the row, normalised); the block-0 program also writes post [T, N] and
    comb [T, N, N]."""
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
    _collapse(streams_ptr, out_ptr, norm_ptr, pre, t, D, stride_st, stride_si, stride_ot, eps, N, NP, BLOCK_D, NORM,
              ROUND_BEFORE_WEIGHT)
    if tl.program_id(1) == 0:
        post = 2 * tl.sigmoid(post_w * post_s + tl.load(base_ptr + N + ri, mask=row, other=0.0))
        tl.store(post_ptr + t * N + ri, post, mask=row)
        logits = comb_w * comb_s + tl.load(base_ptr + cells, mask=valid, other=0.0)
        comb = _sinkhorn(logits, valid, iters, hc_eps)
        tl.store(comb_ptr + t * N * N + ri[:, None] * N + rj[None, :], comb, mask=valid)


@triton.jit
def head_mix_kernel(mix_ptr, ss_ptr, base_ptr, scale_ptr, streams_ptr, out_ptr, norm_ptr,
                    T, D, splits, stride_st, stride_si, stride_ot, norm_eps, hc_eps, eps,
                    N: tl.constexpr, NP: tl.constexpr, MP: tl.constexpr, SPLITS: tl.constexpr,
                    BLOCK_D: tl.constexpr, NORM: tl.constexpr, ROUND_BEFORE_WEIGHT: tl.constexpr,
                    PDL: tl.constexpr):
    """Token ``program_id(0)``: sigmoid weights from the summed partials, and the collapse of one
    block of D (with NORM: of the row, normalised)."""
    t = tl.program_id(0).to(tl.int64)
    ri = tl.arange(0, NP)
    row = ri < N
    rs = tl.arange(0, SPLITS)
    wait_for_prior(PDL)
    mix = _summed(mix_ptr + (rs[:, None] * T + t) * MP + ri[None, :], (rs[:, None] < splits) & row[None, :])
    mix = mix * _rstd(ss_ptr, t, T, N * D, norm_eps, splits, SPLITS)
    pre = tl.sigmoid(mix * tl.load(scale_ptr) + tl.load(base_ptr + ri, mask=row, other=0.0)) + hc_eps
    _collapse(streams_ptr, out_ptr, norm_ptr, tl.where(row, pre, 0.0), t, D, stride_st, stride_si, stride_ot, eps,
              N, NP, BLOCK_D, NORM, ROUND_BEFORE_WEIGHT)


def _check_streams(streams: torch.Tensor) -> torch.Tensor:
    if streams.dim() != 3:
        raise ValueError(f"streams must be [T, n, D], not {list(streams.shape)}")
    if not 1 <= streams.shape[1] <= MAX_STREAMS:
        raise ValueError(f"streams: n = {streams.shape[1]} streams; the kernels take 1 to {MAX_STREAMS}")
    return streams if streams.stride(2) == 1 and streams.stride(1) == streams.shape[2] else streams.contiguous()


def _check_weights(w: MixWeights, streams: torch.Tensor, head: bool) -> None:
    _, n, d = streams.shape
    mixes, scales = (n, 1) if head else ((2 + n) * n, 3)
    for field, got, want in (("fn", w.fn.shape, (mixes, n * d)), ("base", w.base.shape, (mixes,)),
                             ("scale", w.scale.shape, (scales,))):
        if tuple(got) != want:
            raise ValueError(f"MixWeights.{field} is {list(got)}; streams [T, {n}, {d}] need {list(want)}")


def _check_post(block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> None:
    t, n, d = streams.shape
    for field, got, want in (("block_out", block_out.shape, (t, d)), ("post", post.shape, (t, n)),
                             ("comb", comb.shape, (t, n, n))):
        if tuple(got) != want:
            raise ValueError(f"{field} is {list(got)}; streams {list(streams.shape)} need {list(want)}")


def _collapse_launch(streams: torch.Tensor, norm: tuple[torch.Tensor, float] | None, cfg: MixConfig):
    """The collapse's output, the grid of its per-token kernel, and the launch's shape keywords and
    norm arguments: with ``norm`` (weight, eps) one program a token, through that RMSNorm."""
    t, n, d = streams.shape
    block_d = min(cfg.block_d, triton.next_power_of_2(d))
    out = buffer(t, d, dtype=streams.dtype, device=streams.device)
    weight, eps = norm if norm is not None else (out, 0.0)
    if norm is not None and tuple(weight.shape) != (d,):
        raise ValueError(f"norm weight is {list(weight.shape)}; streams [T, {n}, {d}] need [{d}]")
    shape = dict(N=n, NP=triton.next_power_of_2(n), BLOCK_D=block_d, NORM=norm is not None,
                 ROUND_BEFORE_WEIGHT=weight.dtype == streams.dtype != torch.float32, num_warps=cfg.token_warps)
    return out, (t, 1 if norm is not None else triton.cdiv(d, block_d)), shape, (weight, eps)


def _pre_mix(streams: torch.Tensor, w: MixWeights, partials: Partials, norm: tuple[torch.Tensor, float] | None,
             cfg: MixConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    t, n, d = streams.shape
    post = buffer(t, n, dtype=torch.float32, device=streams.device)
    comb = buffer(t, n, n, dtype=torch.float32, device=streams.device)
    out, grid, shape, (weight, eps) = _collapse_launch(streams, norm, cfg)
    splits, _, mp = partials.mix.shape
    if t:
        pre_mix_kernel[grid](*partials, w.base.float(), w.scale.float(), streams, out, post, comb, weight, t, d,
                             splits, streams.stride(0), streams.stride(1), out.stride(0), w.norm_eps, w.hc_eps,
                             w.sinkhorn_iters, eps, MP=mp, SPLITS=triton.next_power_of_2(splits), **shape,
                             **launch_options(streams.device))
    return out, post, comb


def _head_mix(streams: torch.Tensor, w: MixWeights, partials: Partials, norm: tuple[torch.Tensor, float] | None,
              cfg: MixConfig) -> torch.Tensor:
    t, n, d = streams.shape
    out, grid, shape, (weight, eps) = _collapse_launch(streams, norm, cfg)
    splits, _, mp = partials.mix.shape
    if t:
        head_mix_kernel[grid](*partials, w.base.float(), w.scale.float(), streams, out, weight, t, d, splits,
                              streams.stride(0), streams.stride(1), out.stride(0), w.norm_eps, w.hc_eps, eps,
                              MP=mp, SPLITS=triton.next_power_of_2(splits), **shape,
                              **launch_options(streams.device))
    return out


def mhc_pre(streams: torch.Tensor, w: MixWeights,
            norm: tuple[torch.Tensor, float] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``core.native.mhc.hc_pre`` in two launches: streams [T, n, D] -> (collapse [T, D], post [T, n],
    comb [T, n, n]); with ``norm`` (weight, eps) the collapse goes through that RMSNorm in the second."""
    streams = _check_streams(streams)
    _check_weights(w, streams, head=False)
    cfg = config_for(MIX, streams.device)
    return _pre_mix(streams, w, mix_partials(streams, w.fn, cfg.partials), norm, cfg)


def mhc_head(streams: torch.Tensor, w: MixWeights, norm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    """``core.native.mhc.hc_head`` in two launches: streams [T, n, D] -> [T, D], with ``norm`` through
    that RMSNorm."""
    streams = _check_streams(streams)
    _check_weights(w, streams, head=True)
    cfg = config_for(MIX, streams.device)
    return _head_mix(streams, w, mix_partials(streams, w.fn, cfg.partials), norm, cfg)


def mhc_post(block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """``core.native.mhc.hc_post`` in one launch: new streams [T, n, D] in the streams' dtype."""
    streams = _check_streams(streams)
    _check_post(block_out, streams, post, comb)
    return post_mix(block_out, streams, post, comb, None, config_for(MIX, streams.device).post)[0]


def mhc_post_pre(block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                 w: MixWeights, norm: tuple[torch.Tensor, float] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``mhc_post`` and then ``mhc_pre`` of the new streams in two launches: the post writes the
    pre's partials. -> (new streams, collapse, post, comb)."""
    streams = _check_streams(streams)
    _check_post(block_out, streams, post, comb)
    _check_weights(w, streams, head=False)
    cfg = config_for(MIX, streams.device)
    new, partials = post_mix(block_out, streams, post, comb, w.fn, cfg.post)
    return (new, *_pre_mix(new, w, partials, norm, cfg))


def mhc_post_head(block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                  w: MixWeights, norm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    """``mhc_post`` and then ``mhc_head`` of the new streams in two launches."""
    streams = _check_streams(streams)
    _check_post(block_out, streams, post, comb)
    _check_weights(w, streams, head=True)
    cfg = config_for(MIX, streams.device)
    new, partials = post_mix(block_out, streams, post, comb, w.fn, cfg.post)
    return _head_mix(new, w, partials, norm, cfg)


class TritonMHC(MHCBackend):
    """Each boundary in two launches: the post writing the next mix's partials, then the per-token
    mix, its collapse and the RMSNorm after it (``ops`` is not called: the kernel rounds as it does)."""

    name = "triton"
    graph_safe = True  # shapes from the tensors' sizes only; grids depend on T alone

    def pre(self, streams: torch.Tensor, w: MixWeights) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return mhc_pre(streams, w)

    def post(self, block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor,
             comb: torch.Tensor) -> torch.Tensor:
        return mhc_post(block_out, streams, post, comb)

    def head(self, streams: torch.Tensor, w: MixWeights) -> torch.Tensor:
        return mhc_head(streams, w)

    def pre_norm(self, streams: torch.Tensor, w: MixWeights, norm_weight: torch.Tensor, eps: float,
                 ops: NormBackend) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return mhc_pre(streams, w, (norm_weight, eps))

    def post_pre_norm(self, block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                      w: MixWeights, norm_weight: torch.Tensor, eps: float,
                      ops: NormBackend) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return mhc_post_pre(block_out, streams, post, comb, w, (norm_weight, eps))

    def post_head_norm(self, block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                       w: MixWeights, norm_weight: torch.Tensor, eps: float, ops: NormBackend) -> torch.Tensor:
        return mhc_post_head(block_out, streams, post, comb, w, (norm_weight, eps))
