"""DeepSeek-V4's hyper-connection mixes (mHC), batched over the step's tokens: the per-token kernels,
the one-launch sublayer boundary, and the family's Triton backend.

``pre`` and ``head`` project each token's RMS-normalised n * D streams to a few mixing weights; the
product is split along K = n * D into fp32 partials (mhc_partials.py), summed in a fixed order by
mhc_token.py's per-token steps, which apply the scale, bias and gates, run Sinkhorn-Knopp on the
n x n comb in registers and write the collapse sum_i pre_i * streams_i. ``post`` (post_i *
block_out + comb^T streams) is one launch. A pre (a model's first) and a boundary (a sublayer's
post, the next one's pre and the RMSNorm of its collapse, or the head and the final norm) are one
launch each (mhc_boundary.py): the post writes the next mix's partials as it writes the new
streams, and each token block's last program to finish runs the per-token mix, taking a token's
whole row, collapsing it twice: once for the sum of squares, once to write it normalised.
``two_launch_pre`` and ``two_launch_boundary`` are the same in two launches (the product, then
``pre_mix_kernel`` or ``head_mix_kernel``, a token a program), kept to measure against.

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
from .mhc_boundary import arrival_counters, boundary_kernel, pre_kernel
from .mhc_partials import Partials, ProductConfig, buffer, mix_partials, partials_launch, post_launch, post_mix
from .mhc_token import head_token, pre_token
from .pdl import launch_options, wait_for_prior
from .target import config_for


@dataclass(frozen=True)
class MixConfig:
    partials: ProductConfig  # mix_partials: a model's first pre, and pre and head alone
    post: ProductConfig  # post, which at a boundary writes the next mix's partials
    block_d: int  # hidden elements per program of the collapse (and per step of the one with a norm)
    token_warps: int  # warps of the per-token kernels (gates, Sinkhorn-Knopp, collapse)
    boundary_block_d: int  # hidden elements per step of the one-launch boundary's per-token mix


# cuda partials: the best of an H200 sweep of each field around these values at 1/32/128/4096 tokens;
# cuda post: 32-token blocks and 2 stages, where the sm_90 code keeps the product in registers at 16
# and 32 tokens (3 stages spill at 16, 64 tokens at either), not yet timed; boundary_block_d: the
# largest at which the head's boundary kernel keeps to registers on sm_90 (2048 spills), untimed;
# gfx942/gfx950: _cdna's; hip (other AMD archs): guesses


def _cdna(compute_units: int) -> MixConfig:
    """CDNA3 (gfx942, MI300X/MI325X: 304 CUs) and CDNA4 (gfx950, MI355X: 256 CUs), untimed: two
    programs a CU for the split-K products; the one-launch boundary's per-token mix over 2048 hidden
    elements a step, 8 a lane of four 64-wide waves as cuda's 1024 are of four 32-wide warps (at
    V4-Flash its VGPRs stay where 1024 left them, the post's product holding the most: 144 of 512,
    no scratch, tests/backends/triton/test_triton_mhc.py); block_d stays at hip's 1024, which keeps
    the collapse's grid twice as wide as 2048 for a decode step's few tokens."""
    return MixConfig(ProductConfig(block_t=64, block_k=128, programs=2 * compute_units, num_warps=4, num_stages=2),
                     ProductConfig(block_t=32, block_k=128, programs=2 * compute_units, num_warps=4, num_stages=2),
                     block_d=1024, token_warps=4, boundary_block_d=2048)


MIX = {
    "cuda": MixConfig(ProductConfig(block_t=64, block_k=128, programs=264, num_warps=4, num_stages=3),
                      ProductConfig(block_t=32, block_k=128, programs=264, num_warps=4, num_stages=2),
                      block_d=2048, token_warps=4, boundary_block_d=1024),
    "gfx942": _cdna(304),
    "gfx950": _cdna(256),
    "hip": MixConfig(ProductConfig(block_t=64, block_k=128, programs=608, num_warps=4, num_stages=2),
                     ProductConfig(block_t=32, block_k=128, programs=608, num_warps=4, num_stages=2),
                     block_d=1024, token_warps=4, boundary_block_d=1024),
    "default": MixConfig(ProductConfig(block_t=16, block_k=64, programs=4, num_warps=4, num_stages=1),
                         ProductConfig(block_t=16, block_k=64, programs=4, num_warps=4, num_stages=1),
                         block_d=128, token_warps=4, boundary_block_d=128),
}


@triton.jit
def pre_mix_kernel(mix_ptr, ss_ptr, base_ptr, scale_ptr, streams_ptr, out_ptr, post_ptr, comb_ptr, norm_ptr,
                   T, D, splits, stride_st, stride_si, stride_ot, norm_eps, hc_eps, iters, eps,
                   N: tl.constexpr, NP: tl.constexpr, MP: tl.constexpr, SPLITS: tl.constexpr,
                   BLOCK_D: tl.constexpr, NORM: tl.constexpr, ROUND_BEFORE_WEIGHT: tl.constexpr,
                   PDL: tl.constexpr):
    """Token ``program_id(0)``: gates and comb from the summed partials, and the collapse of block
    ``program_id(1)`` of D (with NORM: of the row, normalised); the block-0 program also writes post
    [T, N] and comb [T, N, N]."""
    wait_for_prior(PDL)
    pre_token(mix_ptr, ss_ptr, base_ptr, scale_ptr, streams_ptr, out_ptr, post_ptr, comb_ptr, norm_ptr,
              tl.program_id(0).to(tl.int64), tl.program_id(1), T, D, splits, stride_st, stride_si, stride_ot, norm_eps,
              hc_eps, iters, eps, N, NP, MP, SPLITS, BLOCK_D, NORM, ROUND_BEFORE_WEIGHT)


@triton.jit
def head_mix_kernel(mix_ptr, ss_ptr, base_ptr, scale_ptr, streams_ptr, out_ptr, norm_ptr,
                    T, D, splits, stride_st, stride_si, stride_ot, norm_eps, hc_eps, eps,
                    N: tl.constexpr, NP: tl.constexpr, MP: tl.constexpr, SPLITS: tl.constexpr,
                    BLOCK_D: tl.constexpr, NORM: tl.constexpr, ROUND_BEFORE_WEIGHT: tl.constexpr,
                    PDL: tl.constexpr):
    """Token ``program_id(0)``: sigmoid weights from the summed partials, and the collapse of block
    ``program_id(1)`` of D (with NORM: of the row, normalised)."""
    wait_for_prior(PDL)
    head_token(mix_ptr, ss_ptr, base_ptr, scale_ptr, streams_ptr, out_ptr, norm_ptr, tl.program_id(0).to(tl.int64),
               tl.program_id(1), T, D, splits, stride_st, stride_si, stride_ot, norm_eps, hc_eps, eps, N, NP, MP,
               SPLITS, BLOCK_D, NORM, ROUND_BEFORE_WEIGHT)


def _check_streams(streams: torch.Tensor) -> torch.Tensor:
    if streams.dim() != 3:
        raise ValueError(f"streams must be [T, n, D], not {list(streams.shape)}")
    if not 1 <= streams.shape[1] <= MAX_STREAMS:
        raise ValueError(f"streams: n = {streams.shape[1]} streams; the kernels take 1 to {MAX_STREAMS}")
    # a stride of 0 between streams (one row a token, expanded) is read as it is: no copy, no launch
    return streams if streams.stride(2) == 1 and streams.stride(1) in (0, streams.shape[2]) else streams.contiguous()


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
    """``core.native.mhc.hc_pre`` in one launch (mhc_boundary.pre_kernel): streams [T, n, D] ->
    (collapse [T, D], post [T, n], comb [T, n, n]); with ``norm`` (weight, eps) the collapse goes
    through that RMSNorm."""
    return _first(streams, w, norm, head=False)[:3]


def mhc_head(streams: torch.Tensor, w: MixWeights, norm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    """``core.native.mhc.hc_head`` in one launch: streams [T, n, D] -> [T, D], with ``norm`` through
    that RMSNorm."""
    return _first(streams, w, norm, head=True)[0]


def mhc_post(block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """``core.native.mhc.hc_post`` in one launch: new streams [T, n, D] in the streams' dtype."""
    streams = _check_streams(streams)
    _check_post(block_out, streams, post, comb)
    return post_mix(block_out, streams, post, comb, None, config_for(MIX, streams.device).post)[0]


def _mixes(streams: torch.Tensor, w: MixWeights, norm: tuple[torch.Tensor, float] | None, cfg: MixConfig,
           head: bool, splits: int) -> tuple[tuple, tuple, dict]:
    """The per-token mix's outputs (collapse, next post, next comb; None for the head), and its
    arguments and constexprs in a one-launch kernel whose ``splits`` programs a token block write
    the partials."""
    t, n, d = streams.shape
    x, _, token, (weight, eps) = _collapse_launch(streams, norm, cfg)
    next_post, next_comb = (None, None) if head else (buffer(t, n, dtype=torch.float32, device=streams.device),
                                                      buffer(t, n, n, dtype=torch.float32, device=streams.device))
    outputs = (x, x if head else next_post, x if head else next_comb, weight)
    scalars = (w.norm_eps, w.hc_eps, w.sinkhorn_iters, eps)
    shape = dict(SPLITS=triton.next_power_of_2(splits), TOKEN_BLOCK_D=min(cfg.boundary_block_d,
                 triton.next_power_of_2(d)), HEAD=head, NORM=token["NORM"],
                 ROUND_BEFORE_WEIGHT=token["ROUND_BEFORE_WEIGHT"], N=n, NP=token["NP"])
    return (x, next_post, next_comb), (outputs, scalars), shape


def _first(streams: torch.Tensor, w: MixWeights, norm: tuple[torch.Tensor, float] | None, head: bool):
    """One launch of pre_kernel -> (collapse, post, comb; None for the head)."""
    streams = _check_streams(streams)
    _check_weights(w, streams, head=head)
    cfg = config_for(MIX, streams.device)
    t = streams.shape[0]
    launch = partials_launch(streams, w.fn, cfg.partials)
    out, ((x, post, comb, weight), scalars), shape = _mixes(streams, w, norm, cfg, head, launch.grid[1])
    if t:
        streams_, fn, mix, ss, *sizes = launch.args
        pre_kernel[launch.grid](streams_, fn, mix, ss, arrival_counters(streams.device, launch.grid[0]),
                                w.base.float(), w.scale.float(), x, post, comb, weight, *sizes, streams.stride(1),
                                x.stride(0), *scalars, **shape, **launch.shape, **launch_options(streams.device))
    return out


def _boundary(block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, w: MixWeights,
              norm: tuple[torch.Tensor, float] | None, head: bool):
    """One launch of boundary_kernel -> (new streams, collapse, next post, next comb; None for the head)."""
    streams = _check_streams(streams)
    _check_post(block_out, streams, post, comb)
    _check_weights(w, streams, head=head)
    cfg = config_for(MIX, streams.device)
    launch = post_launch(block_out, streams, post, comb, w.fn, cfg.post)
    out, ((x, next_post, next_comb, weight), scalars), shape = _mixes(launch.out, w, norm, cfg, head,
                                                                         launch.grid[1])
    if streams.shape[0]:
        post_shape = {k: v for k, v in launch.shape.items() if k not in ("PARTIALS", "N", "NP")}
        boundary_kernel[launch.grid](
            *launch.args[:8], arrival_counters(streams.device, launch.grid[0]), w.base.float(), w.scale.float(), x,
            next_post, next_comb, weight, *launch.args[8:], x.stride(0), *scalars, **shape, **post_shape,
            **launch_options(streams.device))
    return (launch.out, *out)


def mhc_post_pre(block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                 w: MixWeights, norm: tuple[torch.Tensor, float] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``mhc_post`` and then ``mhc_pre`` of the new streams in one launch (mhc_boundary.py), with
    ``norm`` through that RMSNorm. -> (new streams, collapse, post, comb)."""
    return _boundary(block_out, streams, post, comb, w, norm, head=False)


def mhc_post_head(block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                  w: MixWeights, norm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    """``mhc_post`` and then ``mhc_head`` of the new streams in one launch."""
    return _boundary(block_out, streams, post, comb, w, norm, head=True)[1]


def two_launch_pre(streams: torch.Tensor, w: MixWeights, norm: tuple[torch.Tensor, float] | None = None,
                   head: bool = False):
    """A pre (or the head) as it ran before it was one launch, to measure against: the split-K
    product, then the per-token kernel. -> mhc_pre's tuple, or mhc_head's collapse."""
    streams = _check_streams(streams)
    _check_weights(w, streams, head=head)
    cfg = config_for(MIX, streams.device)
    partials = mix_partials(streams, w.fn, cfg.partials)
    return _head_mix(streams, w, partials, norm, cfg) if head else _pre_mix(streams, w, partials, norm, cfg)


def two_launch_boundary(block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                        w: MixWeights, norm: tuple[torch.Tensor, float] | None = None, head: bool = False):
    """A boundary as it ran before it was one launch, to measure against: the post writing the next
    mix's partials, then the per-token kernel. -> mhc_post_pre's tuple, or mhc_post_head's collapse."""
    streams = _check_streams(streams)
    _check_post(block_out, streams, post, comb)
    _check_weights(w, streams, head=head)
    cfg = config_for(MIX, streams.device)
    new, partials = post_mix(block_out, streams, post, comb, w.fn, cfg.post)
    return _head_mix(new, w, partials, norm, cfg) if head else (new, *_pre_mix(new, w, partials, norm, cfg))


class TritonMHC(MHCBackend):
    """Each boundary in one launch: the post writing the next mix's partials, and in each token
    block's last program the per-token mix, its collapse and the RMSNorm after it (``ops`` is not
    called: the kernel rounds as it does)."""

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
