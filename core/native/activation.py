"""Gated activations on fused gate/up projections."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2I] (gate first, then up) -> silu(gate) * up [..., I], in x's dtype like HF's MLPs."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
