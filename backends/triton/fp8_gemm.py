"""Block-scaled FP8 GEMM, the DeepSeek-V3 scheme: out = (a * sa) @ (b * sb).T.

``a`` [M, K] is E4M3 with one fp32 scale per token and B channels, ``b`` [N, K] is E4M3 with one
fp32 scale per B x B block: B = 128 (DeepSeek-V3, V4), or 32 (DeepSeek-V4.1), which b's scale's
shape says. The E4M3 tiles go to ``tl.dot`` as they are (on Hopper a ``wgmma`` with e4m3 operands,
both K-major since ``b`` is stored [N, K]) and the product of a K step is scaled in fp32 before it
joins the accumulator, so no dequantized copy is ever made. A K step stays within one block, so
32-blocks take K steps of 32: four scalings of the accumulator where 128-blocks take one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.core.families.linear import MX_BLOCK, fp8_block_edge

from .fp8_quant import e8m0_to_float, quantize_fp8_token_group
from .pdl import launch_options, wait_for_prior
from .target import config_for


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int  # FP8: divides 128, so a K step stays in one scale block (32 for 32-blocks); MXFP8: 32k
    group_m: int  # M tiles that sweep N together, so a band of ``b`` stays in L2
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class GemmTuning:
    """Decode-sized M (at most ``small_m`` rows) reads each weight once, so it wants narrow N tiles
    that spread the weight over every SM; large M wants big tiles that reuse each load."""

    small: GemmConfig
    large: GemmConfig
    small_m: int = 64

    def for_m(self, m: int) -> GemmConfig:
        return self.small if m <= self.small_m else self.large


FP8_GEMM = {  # sm_90: the best geometric means of the H200 sweep (benchmarks/fp8_gemm_sweep.py); others guessed
    "sm_90": GemmTuning(GemmConfig(64, 64, 128, 1, 4, 3), GemmConfig(64, 128, 128, 8, 4, 4)),
    "sm_100": GemmTuning(GemmConfig(64, 64, 128, 1, 4, 4), GemmConfig(128, 128, 128, 8, 4, 3)),
    "gfx942": GemmTuning(GemmConfig(32, 64, 128, 1, 4, 2), GemmConfig(128, 128, 128, 8, 8, 2)),
    "gfx950": GemmTuning(GemmConfig(32, 64, 128, 1, 4, 2), GemmConfig(128, 128, 128, 8, 8, 2)),
    "default": GemmTuning(GemmConfig(16, 32, 128, 1, 4, 1), GemmConfig(32, 32, 128, 2, 4, 1), small_m=16),
}
# DeepSeek-V4.1's 32-blocks: K steps of 32, the tiles of 128-blocks but on sm_100, where a 128 x 128
# tile scaled every 32 of K spills registers (ptxas; none at 64 x 128). Not measured on a GPU.
FP8_GEMM_32 = {
    "sm_90": GemmTuning(GemmConfig(64, 64, 32, 1, 4, 3), GemmConfig(64, 128, 32, 8, 4, 4)),
    "sm_100": GemmTuning(GemmConfig(64, 64, 32, 1, 4, 4), GemmConfig(64, 128, 32, 8, 4, 4)),
    "gfx942": GemmTuning(GemmConfig(32, 64, 32, 1, 4, 2), GemmConfig(128, 128, 32, 8, 8, 2)),
    "gfx950": GemmTuning(GemmConfig(32, 64, 32, 1, 4, 2), GemmConfig(128, 128, 32, 8, 8, 2)),
    "default": GemmTuning(GemmConfig(16, 32, 32, 1, 4, 1), GemmConfig(32, 32, 32, 2, 4, 1), small_m=16),
}
TUNING = {128: FP8_GEMM, 32: FP8_GEMM_32}  # K step's bound (block edge, or MXFP8 activations' 32) -> its table


@triton.jit
def tile_of(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Program id -> (M tile, N tile), GROUP_M tiles of M at a time along N."""
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    rows = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % rows, (pid % per_group) // rows


@triton.jit
def _fp8_block_gemm_kernel(a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, bias_ptr, c_ptr, M, N, K,
                           stride_am, stride_as, stride_bn, stride_bs, stride_cm, stride_ag, stride_asg,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           GROUP_M: tl.constexpr, SCALE_BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr,
                           EVEN_K: tl.constexpr, PDL: tl.constexpr, A_GROUP: tl.constexpr,
                           A_E8M0: tl.constexpr, TILE_SCALE: tl.constexpr):
    """Group ``program_id(1)`` (one, or the grouped output projection's G): its N columns of c from
    its slice of a (stride_ag, its scales stride_asg) and its N rows of b, rows group * N on of the
    whole b, whose blocks a group's rows need not fill (a tiny model's 8-row groups share a 32-block).
    a's scales cover A_GROUP channels of a token (SCALE_BLOCK, or MXFP8's 32), fp32 or, with
    A_E8M0, uint8 E8M0 exponents. TILE_SCALE: every tile's rows lie in one block (``tile_scale``)."""
    tl.static_assert(SCALE_BLOCK % BLOCK_K == 0, "a K step must stay within one scale block")
    tl.static_assert(A_GROUP % BLOCK_K == 0, "a K step must stay within one activation scale group")
    wait_for_prior(PDL)
    group = tl.program_id(1).to(tl.int64)
    a_ptr += group * stride_ag
    a_scale_ptr += group * stride_asg
    b_ptr += group * N * stride_bn
    c_ptr += group * N
    if HAS_BIAS:
        bias_ptr += group * N
    pid_m, pid_n = tile_of(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    # rows past M and N read row 0 / N-1 again instead of being masked; their results are not stored
    am = (rm % M).to(tl.int64)
    bn = (rn % N).to(tl.int64)
    a_ptrs = a_ptr + am[:, None] * stride_am + rk[None, :]
    b_ptrs = b_ptr + bn[None, :] * stride_bn + rk[:, None]
    a_scale_ptrs = a_scale_ptr + am * stride_as
    # a tile within one scale block has one weight scale per K step: the product of a step is then
    # scaled by one vector, a fused multiply-add an element, on the CUDA cores between MMAs
    if TILE_SCALE:
        b_scale_ptrs = b_scale_ptr + ((group * N + pid_n * BLOCK_N) // SCALE_BLOCK) * stride_bs
    else:
        b_scale_ptrs = b_scale_ptr + ((group * N + bn) // SCALE_BLOCK) * stride_bs
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:  # no K tail: unmasked loads, which the compiler can vectorize and pipeline freely
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            a = tl.load(a_ptrs, mask=rk[None, :] < K - k0, other=0.0)
            b = tl.load(b_ptrs, mask=rk[:, None] < K - k0, other=0.0)
        a_scale = tl.load(a_scale_ptrs + k0 // A_GROUP)
        if A_E8M0:
            a_scale = e8m0_to_float(a_scale.to(tl.int32))
        b_scale = tl.load(b_scale_ptrs + k0 // SCALE_BLOCK)
        if TILE_SCALE:
            acc += tl.dot(a, b) * (a_scale * b_scale)[:, None]
        else:
            acc += tl.dot(a, b) * a_scale[:, None] * b_scale[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    store_tile(acc, bias_ptr, c_ptr, rm, rn, M, N, stride_cm, HAS_BIAS)


@triton.jit
def store_tile(acc, bias_ptr, c_ptr, rm, rn, M, N, stride_cm, HAS_BIAS: tl.constexpr):
    """The fp32 tile, plus the bias where there is one, rounded once to the output's dtype."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + rm[:, None].to(tl.int64) * stride_cm + rn[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def unit_inner_stride(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(t if t.stride(-1) == 1 else t.contiguous() for t in tensors)


def output_for(m: int, n: int, dtype: torch.dtype, device: torch.device, out: torch.Tensor | None) -> torch.Tensor:
    """``out`` checked to be [m, n] with unit stride along n, or a new such tensor."""
    if out is None:
        return torch.empty(m, n, dtype=dtype, device=device)
    if out.shape != (m, n) or out.stride(-1) != 1:
        raise ValueError(f"out must be [{m}, {n}] with unit stride along N, not {list(out.shape)}")
    return out


def fp8_block_gemm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                   out_dtype: torch.dtype = torch.bfloat16, bias: torch.Tensor | None = None,
                   out: torch.Tensor | None = None, config: GemmConfig | None = None) -> torch.Tensor:
    """a [M, K] E4M3, a_scale [M, ceil(K/B)], b [N, K] E4M3, b_scale [ceil(N/B), ceil(K/B)] (+ bias
    [N]) -> [M, N] in ``out_dtype``, or written into ``out`` ([M, N], unit stride along N); B, 128 or
    32, is what b_scale's shape says. ``config`` overrides the tuning table (the tuning sweep passes
    each candidate); its K step is cut to B where it is longer."""
    (m, k), n = a.shape, b.shape[0]
    if b.shape[1] != k:
        raise ValueError(f"a is [{m}, {k}] but b is {list(b.shape)}: K must match")
    block = fp8_block_edge((n, k), tuple(b_scale.shape))
    if a_scale.shape != (m, triton.cdiv(k, block)):
        raise ValueError(f"a's scale {list(a_scale.shape)} does not fit a [{m}, {k}] in groups of {block} "
                         f"(b's blocks, from its scale {list(b_scale.shape)})")
    a, a_scale, b, b_scale = unit_inner_stride(a, a_scale, b, b_scale)
    out = output_for(m, n, out_dtype, a.device, out)
    return _launch(a, a_scale, b, b_scale, bias, out, n, block, block, config)


def fp8_block_grouped_gemm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                           out_dtype: torch.dtype = torch.bfloat16, out: torch.Tensor | None = None) -> torch.Tensor:
    """a [M, G, K] E4M3 with scales [M, G, K/A] (fp32 per token and B channels, A = B; or MXFP8's
    uint8 E8M0 exponents, A = 32), b [G * N, K] E4M3 with fp32 scales [G * N / B, ceil(K/B)] ->
    [M, G * N] in ``out_dtype`` (or written into ``out``), group g's N columns being a[:, g] @
    b[g*N:(g+1)*N].T: one launch for every group (DeepSeek-V4's grouped output projection on its
    weight as stored; a block may hold rows of two groups)."""
    if a.dim() != 3 or b.dim() != 2 or b.shape[1] != a.shape[2] or b.shape[0] % a.shape[1]:
        raise ValueError(f"a [M, G, K] and b [G * N, K] do not fit: {list(a.shape)} and {list(b.shape)}")
    (m, groups, k), n = a.shape, b.shape[0] // a.shape[1]
    block = fp8_block_edge(tuple(b.shape), tuple(b_scale.shape))
    e8m0 = a_scale.dtype == torch.uint8
    a_group = MX_BLOCK if e8m0 else block
    if a_scale.shape != (m, groups, triton.cdiv(k, a_group)) or not (e8m0 or a_scale.dtype == torch.float32):
        raise ValueError(f"a's scale {a_scale.dtype} {list(a_scale.shape)} is neither fp32 per {block} channels "
                         f"nor uint8 E8M0 per {MX_BLOCK} of a {list(a.shape)}")
    a, a_scale, b, b_scale = unit_inner_stride(a, a_scale, b, b_scale)
    out = output_for(m, groups * n, out_dtype, a.device, out)
    return _launch(a, a_scale, b, b_scale, None, out, n, block, a_group, None, groups)


def _launch(a, a_scale, b, b_scale, bias, out, n: int, block: int, a_group: int, config: GemmConfig | None,
            groups: int = 1) -> torch.Tensor:
    """The block GEMM over [M, (G,) K] activations whose scales cover ``a_group`` channels: K steps of
    at most the smaller of the weight's blocks and the activations' groups."""
    m, k = a.shape[0], a.shape[-1]
    if m == 0 or n == 0:
        return out
    step = min(block, a_group)
    cfg = config or config_for(TUNING[step], a.device).for_m(m)
    block_k = min(cfg.block_k, step)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n), groups)
    tile_scale = block % cfg.block_n == 0 and (groups == 1 or n % block == 0)
    _fp8_block_gemm_kernel[grid](
        a, a_scale, b, b_scale, bias, out, m, n, k,
        a.stride(0), a_scale.stride(0), b.stride(0), b_scale.stride(0), out.stride(0),
        a.stride(1) if a.dim() == 3 else 0, a_scale.stride(1) if a.dim() == 3 else 0,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k, GROUP_M=cfg.group_m,
        SCALE_BLOCK=block, HAS_BIAS=bias is not None, EVEN_K=k % block_k == 0, A_GROUP=a_group,
        A_E8M0=a_scale.dtype == torch.uint8, TILE_SCALE=tile_scale,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_options(a.device))
    return out


def fp8_block_linear(x: torch.Tensor, weight_data: torch.Tensor, weight_scale: torch.Tensor,
                     bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [..., K] @ dequantized weight.T (+ bias) -> [..., N]: x is quantized per token and as many
    channels as the weight's blocks span first. The output is in ``out_dtype``, by default x's dtype."""
    k = x.shape[-1]
    block = fp8_block_edge(tuple(weight_data.shape), tuple(weight_scale.shape))
    data, scale = quantize_fp8_token_group(x.reshape(-1, k), group=block)
    out = fp8_block_gemm(data, scale, weight_data, weight_scale, out_dtype or x.dtype, bias)
    return out.view(*x.shape[:-1], weight_data.shape[0])
