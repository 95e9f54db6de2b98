"""DeepSeek-V4's sliding-window store: each new token's KV row RMS-normalised, its rope tail turned,
written at its window slot.

``window_rows`` is the store itself, for a block of tokens; ``store_window_kernel`` launches it
alone (sliding layers), and the compressor's launch (v4_compressor.py) runs it beside its own
store where the layer has a compressor, so such a layer writes its window and its compressor's
projections and entries in one launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import launch_options, wait_for_prior
from .tail_rope import rotate_pairs, tail_cos_sin
from .target import config_for


@triton.jit
def window_rows(x_ptr, norm_ptr, cache_ptr, cos_ptr, sin_ptr, positions_ptr, slots_ptr, tok, t_ok,
                stride_x, stride_c, stride_cos, eps,
                HEAD_DIM: tl.constexpr, ROT_HALF: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows ``tok`` [BLOCK_T] (where ``t_ok``) of x, normalised, turned and stored."""
    d = tl.arange(0, BLOCK_D)
    mask = t_ok[:, None] & (d[None, :] < HEAD_DIM)
    pos = tl.load(positions_ptr + tok, mask=t_ok, other=0)
    slot = tl.load(slots_ptr + tok, mask=t_ok, other=0)
    x = tl.load(x_ptr + tok[:, None].to(tl.int64) * stride_x + d[None, :], mask=mask, other=0.0)
    # the RMSNorm as backends/triton/norm.py's kernel runs it with an fp32 weight: one rounding
    h = x.to(tl.float32)
    h = h * tl.rsqrt(tl.sum(h * h, axis=1) / HEAD_DIM + eps)[:, None]
    x = (tl.load(norm_ptr + d, mask=d < HEAD_DIM, other=0.0)[None, :] * h).to(x.dtype)
    cos, sin = tail_cos_sin(cos_ptr, sin_ptr, pos[:, None], stride_cos, x.dtype, HEAD_DIM, ROT_HALF, BLOCK_D)
    y = rotate_pairs(x, cos, sin, BLOCK_T, BLOCK_D).to(x.dtype)
    tl.store(cache_ptr + slot[:, None] * stride_c + d[None, :], y.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def store_window_kernel(x_ptr, norm_ptr, cache_ptr, cos_ptr, sin_ptr, positions_ptr, slots_ptr, num_tokens,
                        stride_x, stride_c, stride_cos, eps,
                        HEAD_DIM: tl.constexpr, ROT_HALF: tl.constexpr, BLOCK_T: tl.constexpr,
                        BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    wait_for_prior(PDL)
    window_rows(x_ptr, norm_ptr, cache_ptr, cos_ptr, sin_ptr, positions_ptr, slots_ptr, tok, tok < num_tokens,
                stride_x, stride_c, stride_cos, eps, HEAD_DIM, ROT_HALF, BLOCK_T, BLOCK_D)


STORE_ELEMENTS = {"cuda": 4096, "hip": 4096, "default": 1 << 16}  # row elements one program turns


def check_window(x: torch.Tensor, norm: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """x [T, D] with unit stride along D, once the cache's rows and the norm's weight fit it."""
    head_dim = x.shape[1]
    if cache.shape[-1] != head_dim:
        raise ValueError(f"window KV rows of {cache.shape[-1]} channels cannot hold kv_new's {head_dim}")
    if tuple(norm.shape) != (head_dim,) or norm.dtype != torch.float32:
        raise ValueError(f"the KV norm's weight is {list(norm.shape)} {norm.dtype}; rows of {head_dim} need "
                         f"[{head_dim}] torch.float32")
    return x if x.stride(-1) == 1 else x.contiguous()


def store_window(x: torch.Tensor, norm: torch.Tensor, eps: float, cache: torch.Tensor, rope, positions: torch.Tensor,
                 slots: torch.Tensor) -> None:
    """RMS-normalise each row of ``x`` [T, D] by the fp32 weight ``norm`` [D] (rounded to x's dtype),
    rotate its tail at ``positions`` [T] (rounded again) and write it to row ``slots[t]`` of
    ``cache`` [slots, D]."""
    x = check_window(x, norm, cache)
    tokens, head_dim = x.shape
    if tokens == 0:
        return
    block_d = triton.next_power_of_2(head_dim)
    block_t = max(1, min(triton.next_power_of_2(tokens), config_for(STORE_ELEMENTS, x.device) // block_d))
    store_window_kernel[(triton.cdiv(tokens, block_t),)](
        x, norm, cache, rope.cos, rope.sin, positions, slots, tokens, x.stride(0), cache.stride(0),
        rope.cos.stride(0), eps,
        HEAD_DIM=head_dim, ROT_HALF=rope.cos.shape[-1], BLOCK_T=block_t, BLOCK_D=block_d,
        num_warps=4, enable_fp_fusion=False, **launch_options(x.device))
