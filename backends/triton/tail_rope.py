"""DeepSeek-V4's interleaved RoPE on the trailing channels of a head, inside a kernel.

The rounding is core/native/tail_rope.py's ``rotate_tail``: cos/sin rounded to the row's dtype,
each pair turned in fp32 (two products and a sum, so launch with ``enable_fp_fusion=False`` to
keep a fused multiply-add from skipping a rounding), the result rounded to the row's dtype by the
caller. A row is turned whole, as pairs: the pairs before the tail get cos 1 and sin 0, which
leaves them exactly as they were.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def tail_cos_sin(cos_ptr, sin_ptr, pos, stride_cos, dtype: tl.constexpr, HEAD_DIM: tl.constexpr,
                 ROT_HALF: tl.constexpr, BLOCK_D: tl.constexpr):
    """cos and sin [..., BLOCK_D // 2] fp32 for every pair of a row at positions ``pos`` [...]
    (a scalar or a [M, 1] column): the tail's ``ROT_HALF`` pairs rounded to ``dtype``, 1 and 0 elsewhere."""
    pair = tl.arange(0, BLOCK_D // 2) - (HEAD_DIM // 2 - ROT_HALF)
    ok = (pair >= 0) & (pair < ROT_HALF)
    offs = pos * stride_cos + pair
    cos = tl.load(cos_ptr + offs, mask=ok, other=1.0).to(dtype).to(tl.float32)
    sin = tl.load(sin_ptr + offs, mask=ok, other=0.0).to(dtype).to(tl.float32)
    return cos, sin


@triton.jit
def rotate_pairs(x, cos, sin, M: tl.constexpr, BLOCK_D: tl.constexpr):
    """x [M, BLOCK_D] -> fp32 [M, BLOCK_D]: each adjacent pair (a, b) becomes (a c - b s, b c + a s)
    with cos/sin [M or 1, BLOCK_D // 2] from ``tail_cos_sin`` (pass -sin to turn back)."""
    a, b = tl.split(tl.reshape(x.to(tl.float32), [M, BLOCK_D // 2, 2]))
    return tl.reshape(tl.join(a * cos - b * sin, b * cos + a * sin), [M, BLOCK_D])
