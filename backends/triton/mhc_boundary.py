"""DeepSeek-V4's mHC sublayer boundary in one launch: the post of sublayer k and the whole pre of
k + 1 (or the head), with the RMSNorm of its collapse; and a model's first pre, with no post before
it, in one launch the same way (``pre_kernel``: the split-K product of the streams in memory).

The grid is the post's (mhc_partials.post_block): token blocks x splits of the hidden size, each
program writing its block of the new streams and its split of the next mix's partial products.
Then each program counts itself in at its token block's arrival counter; the one that arrives last
sees every split written, and runs the per-token mix (mhc_token.py) for each token of the block:
the partials summed in a fixed order (so the result does not depend on the order of arrival), the
gates, Sinkhorn-Knopp in registers, and the collapse of the new streams through the norm. It then
sets the counter back to 0, so that the next launch, and every replay of a CUDA graph, starts from
0. No program waits for another, so no schedule can deadlock it.

Ordering: each program's threads finish their stores (a barrier) before one thread's acq_rel
atomic releases them at GPU scope; the last program's acquire makes every other program's stores
visible to it. The counters are one int32 per token block, zeroed once when allocated and left at
0 by every launch; launches that share them must not overlap, which holds for launches on one
stream (under PDL too: a kernel waits for the one before it before it touches memory). They are
kept per thread and device: the engine runs a device's steps on one stream per thread.
"""

from __future__ import annotations

import threading

import torch
import triton
import triton.language as tl

from .mhc_partials import partials_block, post_block
from .mhc_token import head_token, pre_token
from .pdl import wait_for_prior

_COUNTERS = threading.local()


def arrival_counters(device: torch.device, blocks: int) -> torch.Tensor:
    """At least ``blocks`` int32 counters at 0 on ``device``, the same ones on every call that needs
    no more (graph-safe: no allocation and no fill once warm)."""
    held = _COUNTERS.__dict__.setdefault("by_device", {})
    counters = held.get(device)
    if counters is None or counters.numel() < blocks:
        counters = held[device] = torch.zeros(max(64, triton.next_power_of_2(blocks)), dtype=torch.int32,
                                              device=device)
    return counters


@triton.jit
def _mix_on_arrival(counters_ptr, mix_ptr, ss_ptr, base_ptr, scale_ptr, streams_ptr, x_ptr, next_post_ptr,
                    next_comb_ptr, norm_ptr, T, D, stride_st, stride_si, stride_xt, norm_eps, hc_eps, iters, eps,
                    N: tl.constexpr, NP: tl.constexpr, MP: tl.constexpr, BLOCK_T: tl.constexpr,
                    SPLITS: tl.constexpr, TOKEN_BLOCK_D: tl.constexpr, HEAD: tl.constexpr, NORM: tl.constexpr,
                    ROUND_BEFORE_WEIGHT: tl.constexpr):
    """After a program's split of the partials is written: it counts itself in at its token block's
    counter, and the last to arrive mixes each of the block's tokens of ``streams`` (HEAD: the
    head's collapse x only; else x, next_post and next_comb), with NORM through the RMSNorm
    ``norm_ptr``, then sets the counter back to 0."""
    splits = tl.num_programs(1)
    tl.debug_barrier()  # every thread's stores before the release
    arrived = tl.atomic_add(counters_ptr + tl.program_id(0), 1, sem="acq_rel", scope="gpu")
    if arrived == splits - 1:
        tl.store(counters_ptr + tl.program_id(0), 0)
        first = tl.program_id(0).to(tl.int64) * BLOCK_T
        for t in range(first, tl.minimum(first + BLOCK_T, T)):
            if HEAD:
                head_token(mix_ptr, ss_ptr, base_ptr, scale_ptr, streams_ptr, x_ptr, norm_ptr, t, -1, T, D, splits,
                           stride_st, stride_si, stride_xt, norm_eps, hc_eps, eps, N, NP, MP, SPLITS, TOKEN_BLOCK_D,
                           NORM, ROUND_BEFORE_WEIGHT)
            else:
                pre_token(mix_ptr, ss_ptr, base_ptr, scale_ptr, streams_ptr, x_ptr, next_post_ptr, next_comb_ptr,
                          norm_ptr, t, -1, T, D, splits, stride_st, stride_si, stride_xt, norm_eps, hc_eps, iters,
                          eps, N, NP, MP, SPLITS, TOKEN_BLOCK_D, NORM, ROUND_BEFORE_WEIGHT)


@triton.jit
def boundary_kernel(block_out_ptr, streams_ptr, post_ptr, comb_ptr, new_ptr, fn_ptr, mix_ptr, ss_ptr, counters_ptr,
                    base_ptr, scale_ptr, x_ptr, next_post_ptr, next_comb_ptr, norm_ptr,
                    T, D, M, d_per_split, stride_bt, stride_st, stride_si, stride_pt, stride_ct, stride_nt,
                    stride_ni, stride_fn, stride_xt, norm_eps, hc_eps, iters, eps,
                    N: tl.constexpr, NP: tl.constexpr, MP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                    SPLITS: tl.constexpr, TOKEN_BLOCK_D: tl.constexpr, HEAD: tl.constexpr, NORM: tl.constexpr,
                    ROUND_BEFORE_WEIGHT: tl.constexpr, PDL: tl.constexpr):
    """Program (token block, split of D): its part of the post (the new streams ``new_ptr``) and of
    the next mix's partials; the block's last program to arrive then mixes its tokens."""
    wait_for_prior(PDL)
    post_block(block_out_ptr, streams_ptr, post_ptr, comb_ptr, new_ptr, fn_ptr, mix_ptr, ss_ptr, T, D, M,
               d_per_split, stride_bt, stride_st, stride_si, stride_pt, stride_ct, stride_nt, stride_ni, stride_fn,
               N, NP, MP, BLOCK_T, BLOCK_D, True)
    _mix_on_arrival(counters_ptr, mix_ptr, ss_ptr, base_ptr, scale_ptr, new_ptr, x_ptr, next_post_ptr, next_comb_ptr,
                    norm_ptr, T, D, stride_nt, stride_ni, stride_xt, norm_eps, hc_eps, iters, eps, N, NP, MP, BLOCK_T,
                    SPLITS, TOKEN_BLOCK_D, HEAD, NORM, ROUND_BEFORE_WEIGHT)


@triton.jit
def pre_kernel(streams_ptr, fn_ptr, mix_ptr, ss_ptr, counters_ptr, base_ptr, scale_ptr, x_ptr, next_post_ptr,
               next_comb_ptr, norm_ptr, T, M, K, k_per_split, stride_st, stride_fn, D, stride_si, stride_xt,
               norm_eps, hc_eps, iters, eps,
               N: tl.constexpr, NP: tl.constexpr, MP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
               SPLITS: tl.constexpr, TOKEN_BLOCK_D: tl.constexpr, HEAD: tl.constexpr, NORM: tl.constexpr,
               ROUND_BEFORE_WEIGHT: tl.constexpr, BROADCAST: tl.constexpr, PDL: tl.constexpr):
    """A pre (or the head) with no post before it, a model's first: program (token block, split of
    K = N * D) writes its partials of the streams in memory; the block's last program to arrive then
    mixes its tokens. BROADCAST: every stream of a token is one row (stride_si 0), the embedding's."""
    wait_for_prior(PDL)
    partials_block(streams_ptr, fn_ptr, mix_ptr, ss_ptr, T, M, K, k_per_split, stride_st, stride_fn, D, BLOCK_T,
                   BLOCK_K, MP, BROADCAST)
    _mix_on_arrival(counters_ptr, mix_ptr, ss_ptr, base_ptr, scale_ptr, streams_ptr, x_ptr, next_post_ptr,
                    next_comb_ptr, norm_ptr, T, D, stride_st, stride_si, stride_xt, norm_eps, hc_eps, iters, eps, N,
                    NP, MP, BLOCK_T, SPLITS, TOKEN_BLOCK_D, HEAD, NORM, ROUND_BEFORE_WEIGHT)
