"""Rotary embedding of q and k fused with the store of the step's K/V into their pages.

One launch replaces the rotation of q, the rotation of k, and the two page writes: each program
takes one token and a block of heads, either query heads (rotated into the output) or KV heads
(k rotated and v copied straight into the token's slot of ``LayerKV.k``/``.v``). The slot is
``batch.slot_mapping``, as in the native attention's store; a negative slot (a padded token)
writes nothing. Rounding follows core/native/rope.py: cos/sin are rounded to the activation
dtype and every product and sum of the rotation is rounded to it, as the torch ops do.

Qwen3's per-head RMSNorm of q and k (a ``QKNorm``) runs in the same program, on the row it has
loaded for the rotation, so the two norm launches of each layer go too. Its rounding follows
core/native/norm.py: fp32 statistics, the normalised row rounded to the activation dtype before a
weight of that dtype multiplies it, the product rounded to it again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.core.families.attention import LayerKV, QKNorm
from engine.core.native.rope import RotaryEmbedding

from .pdl import launch_options, wait_for_prior
from .target import config_for


@dataclass(frozen=True)
class RopeConfig:
    pairs_per_program: int  # heads x rotated pairs one program holds
    num_warps: int


ROPE_KV = {
    "cuda": RopeConfig(pairs_per_program=1024, num_warps=4),
    "hip": RopeConfig(pairs_per_program=2048, num_warps=4),
    "default": RopeConfig(pairs_per_program=1 << 20, num_warps=1),  # the interpreter: all heads at once
}


@triton.jit
def _normalized(x, weight, inv_rms, mask, ROUND_BEFORE_WEIGHT: tl.constexpr):
    """One piece of the heads' rows as core/native/norm.py's rms_norm returns it, in x's dtype."""
    h = x.to(tl.float32) * inv_rms[:, None]
    if ROUND_BEFORE_WEIGHT:
        h = h.to(x.dtype).to(tl.float32)
    w = tl.load(weight, mask=mask, other=0.0).to(tl.float32)
    return (w[None, :] * h).to(x.dtype)


@triton.jit
def _rotate_heads(src, stride_src_h, dst, stride_dst_h, heads, head_mask, cos, sin, norm_weight, eps,
                  HEAD_DIM: tl.constexpr, ROT_HALF: tl.constexpr, IS_NEOX: tl.constexpr, QK_NORM: tl.constexpr,
                  ROUND_BEFORE_WEIGHT: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr):
    """Rotates heads ``heads`` of one token row at ``src`` into ``dst``; the unrotated tail is copied.

    With ``QK_NORM`` each head is RMS-normalised by ``norm_weight`` [HEAD_DIM] first: the row is
    loaded once, as its two rotated halves and its tail, and the sum of squares adds up all three.
    """
    half = tl.arange(0, BLOCK_HALF)
    half_mask = half < ROT_HALF
    mask = head_mask[:, None] & half_mask[None, :]
    if IS_NEOX:
        first, second = half, half + ROT_HALF
    else:
        first, second = 2 * half, 2 * half + 1
    src_rows = src + heads[:, None] * stride_src_h
    dst_rows = dst + heads[:, None] * stride_dst_h
    x1 = tl.load(src_rows + first[None, :], mask=mask, other=0.0)
    x2 = tl.load(src_rows + second[None, :], mask=mask, other=0.0)
    if BLOCK_REST > 0:
        rest = 2 * ROT_HALF + tl.arange(0, BLOCK_REST)
        rest_mask = head_mask[:, None] & (rest < HEAD_DIM)[None, :]
        tail = tl.load(src_rows + rest[None, :], mask=rest_mask, other=0.0)
    dt = x1.dtype
    if QK_NORM:
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        squares = tl.sum(f1 * f1, axis=1) + tl.sum(f2 * f2, axis=1)
        if BLOCK_REST > 0:
            ft = tail.to(tl.float32)
            squares += tl.sum(ft * ft, axis=1)
        inv_rms = tl.rsqrt(squares / HEAD_DIM + eps)
        x1 = _normalized(x1, norm_weight + first, inv_rms, half_mask, ROUND_BEFORE_WEIGHT)
        x2 = _normalized(x2, norm_weight + second, inv_rms, half_mask, ROUND_BEFORE_WEIGHT)
        if BLOCK_REST > 0:
            tail = _normalized(tail, norm_weight + rest, inv_rms, rest < HEAD_DIM, ROUND_BEFORE_WEIGHT)
    c = cos.to(dt).to(tl.float32)[None, :]
    s = sin.to(dt).to(tl.float32)[None, :]
    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
    o1 = (x1 * c).to(dt).to(tl.float32) - (x2 * s).to(dt).to(tl.float32)
    o2 = (x2 * c).to(dt).to(tl.float32) + (x1 * s).to(dt).to(tl.float32)
    out_ty = dst.dtype.element_ty
    tl.store(dst_rows + first[None, :], o1.to(dt).to(out_ty), mask=mask)
    tl.store(dst_rows + second[None, :], o2.to(dt).to(out_ty), mask=mask)
    if BLOCK_REST > 0:
        tl.store(dst_rows + rest[None, :], tail.to(out_ty), mask=rest_mask)


@triton.jit
def rope_store_kv_kernel(
    q_ptr, k_ptr, v_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, cos_ptr, sin_ptr, positions_ptr, slots_ptr,
    q_norm_ptr, k_norm_ptr, eps,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_kcp, stride_kcs, stride_kch, stride_vcp, stride_vcs, stride_vch, stride_cos,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, V_HEAD_DIM: tl.constexpr,
    ROT_HALF: tl.constexpr, PAGE_SIZE: tl.constexpr, IS_NEOX: tl.constexpr, Q_BLOCKS: tl.constexpr,
    QK_NORM: tl.constexpr, ROUND_BEFORE_WEIGHT: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr, BLOCK_DV: tl.constexpr, PDL: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    half = tl.arange(0, BLOCK_HALF)
    wait_for_prior(PDL)
    pos = tl.load(positions_ptr + token)
    cos = tl.load(cos_ptr + pos * stride_cos + half, mask=half < ROT_HALF, other=0.0)
    sin = tl.load(sin_ptr + pos * stride_cos + half, mask=half < ROT_HALF, other=0.0)
    if block < Q_BLOCKS:
        heads = block * BLOCK_H + tl.arange(0, BLOCK_H)
        _rotate_heads(q_ptr + token * stride_qt, stride_qh, q_out_ptr + token * stride_ot, stride_oh,
                      heads, heads < NUM_HEADS, cos, sin, q_norm_ptr, eps,
                      HEAD_DIM, ROT_HALF, IS_NEOX, QK_NORM, ROUND_BEFORE_WEIGHT, BLOCK_HALF, BLOCK_REST)
    else:
        slot = tl.load(slots_ptr + token)
        if slot >= 0:
            page, offset = slot // PAGE_SIZE, slot % PAGE_SIZE
            heads = (block - Q_BLOCKS) * BLOCK_H + tl.arange(0, BLOCK_H)
            head_mask = heads < NUM_KV_HEADS
            _rotate_heads(k_ptr + token * stride_kt, stride_kh,
                          k_cache_ptr + page * stride_kcp + offset * stride_kcs, stride_kch,
                          heads, head_mask, cos, sin, k_norm_ptr, eps,
                          HEAD_DIM, ROT_HALF, IS_NEOX, QK_NORM, ROUND_BEFORE_WEIGHT, BLOCK_HALF, BLOCK_REST)
            dv = tl.arange(0, BLOCK_DV)
            mask = head_mask[:, None] & (dv < V_HEAD_DIM)[None, :]
            v = tl.load(v_ptr + token * stride_vt + heads[:, None] * stride_vh + dv[None, :], mask=mask)
            v_dst = v_cache_ptr + page * stride_vcp + offset * stride_vcs + heads[:, None] * stride_vch
            tl.store(v_dst + dv[None, :], v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def rope_store_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                  slot_mapping: torch.Tensor, rope: RotaryEmbedding, kv: LayerKV,
                  q_out: torch.Tensor | None = None, qk_norm: QKNorm | None = None) -> torch.Tensor:
    """Rotated q [T, H, D]; rotated k [T, Hk, D] and v [T, Hk, Dv] stored at ``slot_mapping`` [T].

    ``positions`` [T] index ``rope``'s cos/sin cache; ``kv.k``/``kv.v`` are
    [num_pages, page_size, Hk, D]/[..., Dv] in any dtype k and v cast to. ``qk_norm``: q and k are
    RMS-normalised per head before they turn.
    """
    (tokens, num_heads, head_dim), (_, num_kv_heads, _), v_head_dim = q.shape, k.shape, v.shape[-1]
    if k.shape != (tokens, num_kv_heads, head_dim) or v.shape[:2] != (tokens, num_kv_heads):
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit together")
    if kv.k.shape[2:] != (num_kv_heads, head_dim) or kv.v.shape != (*kv.k.shape[:3], v_head_dim):
        raise ValueError(f"pages k {tuple(kv.k.shape)}, v {tuple(kv.v.shape)} do not fit k and v")
    if rope.head_dim != head_dim:
        raise ValueError(f"rotary embedding is for head dim {rope.head_dim}, q has {head_dim}")
    if qk_norm is not None and not (qk_norm.q_weight.shape == qk_norm.k_weight.shape == (head_dim,)
                                    and qk_norm.q_weight.dtype == qk_norm.k_weight.dtype):
        raise ValueError(f"q/k norm weights {tuple(qk_norm.q_weight.shape)} {qk_norm.q_weight.dtype}, "
                         f"{tuple(qk_norm.k_weight.shape)} {qk_norm.k_weight.dtype}: need [{head_dim}], one dtype")
    q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
    q_weight, k_weight = (q, q) if qk_norm is None else (qk_norm.q_weight, qk_norm.k_weight)
    q_out = torch.empty_like(q) if q_out is None else q_out
    if kv.k.stride(-1) != 1 or kv.v.stride(-1) != 1 or q_out.stride(-1) != 1:
        raise ValueError("pages and q_out need unit stride along the head dim")
    cos, sin = rope.cos, rope.sin  # [max_position, rotary_dim // 2], one layout
    rot_half = rope.rotary_dim // 2
    block_half = triton.next_power_of_2(rot_half)
    rest = head_dim - rope.rotary_dim
    cfg = config_for(ROPE_KV, q.device)
    block_h = max(1, min(triton.next_power_of_2(max(num_heads, num_kv_heads)), cfg.pairs_per_program // block_half))
    q_blocks, kv_blocks = triton.cdiv(num_heads, block_h), triton.cdiv(num_kv_heads, block_h)
    rope_store_kv_kernel[(tokens, q_blocks + kv_blocks)](
        q, k, v, q_out, kv.k, kv.v, cos, sin, positions, slot_mapping,
        q_weight, k_weight, qk_norm.eps if qk_norm is not None else 0.0,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        q_out.stride(0), q_out.stride(1),
        kv.k.stride(0), kv.k.stride(1), kv.k.stride(2), kv.v.stride(0), kv.v.stride(1), kv.v.stride(2),
        cos.stride(0),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, V_HEAD_DIM=v_head_dim,
        ROT_HALF=rot_half, PAGE_SIZE=kv.k.shape[1], IS_NEOX=rope.is_neox_style, Q_BLOCKS=q_blocks,
        QK_NORM=qk_norm is not None,  # and the weight's rounding as in backends/triton/norm.py:
        ROUND_BEFORE_WEIGHT=qk_norm is not None and q_weight.dtype == q.dtype != torch.float32,
        BLOCK_H=block_h, BLOCK_HALF=block_half,
        BLOCK_REST=triton.next_power_of_2(rest) if rest else 0, BLOCK_DV=triton.next_power_of_2(v_head_dim),
        num_warps=cfg.num_warps, enable_fp_fusion=False,  # a fused multiply-add skips a rounding step
        **launch_options(q.device),
    )
    return q_out
