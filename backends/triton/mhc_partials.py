"""The split-K products of DeepSeek-V4's hyper-connection mixes (mHC): each token's n * D streams,
flattened, times a mix's ``fn`` [M, n * D] (M = (2 + n) * n = 24 for a sublayer's pre, n for the
head), with their sum of squares, written as fp32 partials that mhc.py's per-token kernels sum.

Normalising before a linear map equals scaling the product by 1 / rms, so one pass over the
streams yields both the raw product and the sum of squares. K = n * D (16384 at V4-Flash) is split
over many programs, each writing its partials [split, T, MP] and [split, T]; the per-token kernel
sums them over the splits in a fixed order (deterministic, no atomics). The partials come from
streams in memory (``mix_partials``: a model's first pre), or from the post as it writes the new
streams (``post_block`` given the next mix's fn): a program that writes a block of D of every
stream also multiplies that block into the next mix, so that the same launch can go on to the next
pre's per-token mix (mhc_boundary.py). Its splits are ranges of D, each holding the columns
i * D + d of every stream i; its sums differ from mix_partials' by fp32 rounding alone.

With 16-bit streams the fp32 weight is split into two 16-bit parts (hi + lo, 16 mantissa bits
together) so that the product runs on the matrix units at nearly fp32 accuracy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .pdl import launch_options, wait_for_prior

SMALL_T = 16  # the smallest M of tl.dot


@dataclass(frozen=True)
class ProductConfig:
    block_t: int  # tokens per program (16 where there are at most 16)
    block_k: int  # streams' elements per step along K (post: n rounded up to a power of 2 times a block of D)
    programs: int  # the grid aims at this many programs (tokens x splits of K)
    num_warps: int
    num_stages: int


class Partials(NamedTuple):
    """A mix's split-K partials: mix [splits, T, MP] (columns past fn's rows are not to be read) and
    ss [splits, T], fp32."""

    mix: torch.Tensor
    ss: torch.Tensor


@triton.jit
def _accumulate(x, w, acc):
    """acc + x @ w, x in the streams' dtype, w fp32: exact fp32 products for fp32 x; for 16-bit x,
    w split into hi + lo parts in x's dtype, so that the products run on the matrix units."""
    if x.dtype == tl.float32:
        acc = tl.dot(x, w, acc, input_precision="ieee")
    else:
        hi = w.to(x.dtype)
        acc = tl.dot(x, hi, acc)
        acc = tl.dot(x, (w - hi.to(tl.float32)).to(x.dtype), acc)
    return acc


@triton.jit
def _store(mix_ptr, ss_ptr, acc, ss, split, rt, T, MP: tl.constexpr):
    """Tokens ``rt``'s partials of one split: mix [split, T, MP] and ss [split, T]; rows past T are not stored."""
    at = (split * T + rt).to(tl.int64)
    tl.store(mix_ptr + at[:, None] * MP + tl.arange(0, MP)[None, :], acc, mask=(rt < T)[:, None])
    tl.store(ss_ptr + at, ss, mask=rt < T)


@triton.jit
def partials_block(x_ptr, fn_ptr, mix_ptr, ss_ptr, T, M, K, k_per_split, stride_x, stride_fn, D,
                   BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, MP: tl.constexpr, BROADCAST: tl.constexpr):
    """Tokens of block ``program_id(0)``, split ``program_id(1)`` of K: x [T, K] @ fn [M, K].T ->
    mix [split, T, MP] and the sum of x^2 -> ss [split, T], both fp32. Columns past M reread fn's
    last row; nothing reads them. BROADCAST: x is one row of D a token, every stream of K = N * D
    that row (a model's first streams, the embedding's row spread over them, never written out)."""
    split = tl.program_id(1)
    rt = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    rows = tl.minimum(rt, T - 1).to(tl.int64)  # rows past T reread the last one; they are not stored
    rm = tl.minimum(tl.arange(0, MP), M - 1).to(tl.int64)
    rk0 = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_T, MP), dtype=tl.float32)
    ss = tl.zeros((BLOCK_T,), dtype=tl.float32)
    k_start = split * k_per_split
    for k0 in range(k_start, tl.minimum(k_start + k_per_split, K), BLOCK_K):
        rk = k0 + rk0
        if BROADCAST:
            cols = rk % D
        else:
            cols = rk
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=rk[None, :] < K, other=0.0)
        w = tl.load(fn_ptr + rm[None, :] * stride_fn + rk[:, None], mask=rk[:, None] < K, other=0.0).to(tl.float32)
        xf = x.to(tl.float32)
        ss += tl.sum(xf * xf, axis=1)
        acc = _accumulate(x, w, acc)
    _store(mix_ptr, ss_ptr, acc, ss, split, rt, T, MP)


@triton.jit
def mix_partials_kernel(x_ptr, fn_ptr, mix_ptr, ss_ptr, T, M, K, k_per_split, stride_x, stride_fn, D,
                        BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, MP: tl.constexpr, BROADCAST: tl.constexpr,
                        PDL: tl.constexpr):
    """``partials_block`` as a launch of its own."""
    wait_for_prior(PDL)
    partials_block(x_ptr, fn_ptr, mix_ptr, ss_ptr, T, M, K, k_per_split, stride_x, stride_fn, D, BLOCK_T, BLOCK_K, MP,
                   BROADCAST)


@triton.jit
def post_block(block_out_ptr, streams_ptr, post_ptr, comb_ptr, out_ptr, fn_ptr, mix_ptr, ss_ptr,
               T, D, M, d_per_split, stride_bt, stride_st, stride_si, stride_pt, stride_ct, stride_ot, stride_oi,
               stride_fn, N: tl.constexpr, NP: tl.constexpr, MP: tl.constexpr, BLOCK_T: tl.constexpr,
               BLOCK_D: tl.constexpr, PARTIALS: tl.constexpr):
    """Tokens of block ``program_id(0)``, hidden elements of split ``program_id(1)``:
    out[t, i, d] = post[t, i] * block_out[t, d] + sum_j comb[t, j, i] * streams[t, j, d], each
    product rounded to the streams' dtype before the sum, as core/native/mhc.py's ``hc_post``. With
    PARTIALS, also the next mix's partials over this split's columns i * D + d of the new streams
    flattened, as mix_partials_kernel writes them: out @ fn [M, N * D].T -> mix [split, T, MP] and
    the sum of out^2 -> ss [split, T]."""
    split = tl.program_id(1)
    rt = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    keep = rt < T
    rows = tl.minimum(rt, T - 1).to(tl.int64)  # rows past T redo the last one; they are not stored
    ri = tl.arange(0, NP)
    live = ri < N
    rd0 = tl.arange(0, BLOCK_D)
    rm = tl.minimum(tl.arange(0, MP), M - 1).to(tl.int64)
    ty = out_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_T, MP), dtype=tl.float32)
    ss = tl.zeros((BLOCK_T,), dtype=tl.float32)
    d_start = split * d_per_split
    for d0 in range(d_start, tl.minimum(d_start + d_per_split, D), BLOCK_D):
        rd = d0 + rd0
        cols = rd < D
        x = tl.load(block_out_ptr + rows[:, None] * stride_bt + rd[None, :], mask=cols[None, :], other=0.0)
        s = tl.load(streams_ptr + rows[:, None, None] * stride_st + ri[None, :, None] * stride_si + rd[None, None, :],
                    mask=live[None, :, None] & cols[None, None, :], other=0.0).to(tl.float32)
        for i in tl.static_range(N):
            post = tl.load(post_ptr + rows * stride_pt + i).to(ty).to(tl.float32)
            comb = tl.load(comb_ptr + rows[:, None] * stride_ct + ri[None, :] * N + i, mask=live[None, :], other=0.0)
            mixed = tl.sum(comb.to(ty).to(tl.float32)[:, :, None] * s, axis=1)
            expanded = (post[:, None] * x.to(tl.float32)).to(ty).to(tl.float32)
            out = (expanded + mixed.to(ty).to(tl.float32)).to(ty)
            tl.store(out_ptr + rows[:, None] * stride_ot + i * stride_oi + rd[None, :], out,
                     mask=keep[:, None] & cols[None, :])
            if PARTIALS:
                of = out.to(tl.float32)
                ss += tl.sum(of * of, axis=1)
                w = tl.load(fn_ptr + rm[None, :] * stride_fn + i * D + rd[:, None], mask=cols[:, None], other=0.0)
                acc = _accumulate(out, w, acc)
    if PARTIALS:
        _store(mix_ptr, ss_ptr, acc, ss, split, rt, T, MP)


@triton.jit
def post_mix_kernel(block_out_ptr, streams_ptr, post_ptr, comb_ptr, out_ptr, fn_ptr, mix_ptr, ss_ptr,
                    T, D, M, d_per_split, stride_bt, stride_st, stride_si, stride_pt, stride_ct, stride_ot,
                    stride_oi, stride_fn,
                    N: tl.constexpr, NP: tl.constexpr, MP: tl.constexpr, BLOCK_T: tl.constexpr,
                    BLOCK_D: tl.constexpr, PARTIALS: tl.constexpr, PDL: tl.constexpr):
    """``post_block`` as a launch of its own."""
    wait_for_prior(PDL)
    post_block(block_out_ptr, streams_ptr, post_ptr, comb_ptr, out_ptr, fn_ptr, mix_ptr, ss_ptr, T, D, M, d_per_split,
               stride_bt, stride_st, stride_si, stride_pt, stride_ct, stride_ot, stride_oi, stride_fn, N, NP, MP,
               BLOCK_T, BLOCK_D, PARTIALS)


def buffer(*shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every buffer the mHC launches write (tests fill them with NaN first)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _grid(t: int, length: int, block: int, cfg: ProductConfig) -> tuple[int, int, int]:
    """(tokens per program, elements per split, splits) of a product over ``length`` elements in
    steps of ``block``: the grid aims at cfg.programs programs."""
    block_t = SMALL_T if t <= SMALL_T else cfg.block_t
    t_blocks, chunks = max(1, triton.cdiv(t, block_t)), triton.cdiv(length, block)
    per_split = triton.cdiv(chunks, max(1, min(chunks, triton.cdiv(cfg.programs, t_blocks)))) * block
    return block_t, per_split, triton.cdiv(length, per_split)


def _with_buffers(fn: torch.Tensor, splits: int, t: int) -> tuple[torch.Tensor, Partials]:
    """fn with unit column stride, and the partials' buffers: fn's rows padded to a power of two
    (MP), at least tl.dot's 16."""
    mp = max(SMALL_T, triton.next_power_of_2(fn.shape[0]))
    return (fn if fn.stride(1) == 1 else fn.contiguous(),
            Partials(buffer(splits, t, mp, dtype=torch.float32, device=fn.device),
                     buffer(splits, t, dtype=torch.float32, device=fn.device)))


class ProductLaunch(NamedTuple):
    """A product's grid (token blocks x splits), its arguments up to its constexprs, those, the new
    streams it writes (a post's; None for mix_partials) and the partials it writes."""

    grid: tuple[int, int]
    args: tuple
    shape: dict
    out: torch.Tensor | None
    partials: Partials | None


def partials_launch(streams: torch.Tensor, fn: torch.Tensor, cfg: ProductConfig) -> ProductLaunch:
    """What ``partials_block`` is launched with for streams [T, n, D] (unit stride within a token,
    or a stride of 0 between its streams: one row each) and fn [M, n * D]."""
    t, n, d = streams.shape
    block_t, k_per_split, splits = _grid(t, n * d, cfg.block_k, cfg)
    fn, partials = _with_buffers(fn, splits, t)
    args = (streams, fn, *partials, t, fn.shape[0], n * d, k_per_split, streams.stride(0), fn.stride(0), d)
    shape = dict(BLOCK_T=block_t, BLOCK_K=cfg.block_k, MP=partials.mix.shape[2],
                 BROADCAST=n > 1 and streams.stride(1) == 0, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return ProductLaunch((triton.cdiv(t, block_t), splits), args, shape, None, partials)


def mix_partials(streams: torch.Tensor, fn: torch.Tensor, cfg: ProductConfig) -> Partials:
    """The partials of streams [T, n, D] (as ``partials_launch`` takes them) and fn [M, n * D], one launch."""
    launch = partials_launch(streams, fn, cfg)
    if streams.shape[0]:
        mix_partials_kernel[launch.grid](*launch.args, **launch.shape, **launch_options(streams.device))
    return launch.partials


def post_launch(block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                fn: torch.Tensor | None, cfg: ProductConfig) -> ProductLaunch:
    """What ``post_block`` is launched with: the new streams [T, n, D] it writes, and with ``fn`` the
    partials of the next mix it writes too."""
    t, n, d = streams.shape
    block_out = block_out if block_out.stride(-1) == 1 else block_out.contiguous()
    post, comb = post.contiguous(), comb.contiguous()
    np2 = triton.next_power_of_2(n)
    block_d = max(SMALL_T, cfg.block_k // np2)  # a step's K: np2 * block_d, mix_partials' block_k
    block_t, d_per_split, splits = _grid(t, d, block_d, cfg)
    out = buffer(t, n, d, dtype=streams.dtype, device=streams.device)
    fn, partials = _with_buffers(fn, splits, t) if fn is not None else (streams, None)  # unread without partials
    mix, ss = partials or (out, out)
    args = (block_out, streams, post, comb, out, fn, mix, ss, t, d, fn.shape[0], d_per_split, block_out.stride(0),
            streams.stride(0), streams.stride(1), post.stride(0), comb.stride(0), out.stride(0), out.stride(1),
            fn.stride(0))
    shape = dict(N=n, NP=np2, MP=SMALL_T if partials is None else mix.shape[2], BLOCK_T=block_t, BLOCK_D=block_d,
                 PARTIALS=partials is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                 enable_fp_fusion=False)  # a fused multiply-add would skip the rounding of post * block_out
    return ProductLaunch((triton.cdiv(t, block_t), splits), args, shape, out, partials)


def post_mix(block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
             fn: torch.Tensor | None, cfg: ProductConfig) -> tuple[torch.Tensor, Partials | None]:
    """The new streams [T, n, D] (``core.native.mhc.hc_post``), and with ``fn`` the next mix's
    partials of them, in one launch."""
    launch = post_launch(block_out, streams, post, comb, fn, cfg)
    if streams.shape[0]:
        post_mix_kernel[launch.grid](*launch.args, **launch.shape, **launch_options(streams.device))
    return launch.out, launch.partials
