"""Interleaved RoPE on the trailing channels of each head, as DeepSeek-V4 lays heads out: [nope | rope]."""

from __future__ import annotations

import torch


def rotate_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs of the last ``2 * cos.shape[-1]`` channels of x in fp32.

    ``cos``/``sin`` [..., rope_dim // 2] broadcast against x's leading axes; passing ``-sin``
    rotates back (V4 un-rotates the attention output, whose values carry the keys' rotation).
    """
    rope_dim = 2 * cos.shape[-1]
    nope, rope = x[..., :-rope_dim], x[..., -rope_dim:].float()
    x1, x2 = rope[..., 0::2], rope[..., 1::2]
    cos, sin = cos.to(x.dtype).float(), sin.to(x.dtype).float()
    rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2).to(x.dtype)
    return torch.cat([nope, rotated], dim=-1)
