"""RMSNorm with HF's rounding order, so model logits can match HF transformers bit for bit; and the
norm family's native backend, the oracle of the fast ones."""

from __future__ import annotations

import torch

from ..families.norm import NormBackend
from .activation import silu_and_mul


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * weight over the last axis, normalised in fp32, returned in x's dtype.

    The product with ``weight`` is taken in the wider of the two dtypes: a weight in x's dtype
    multiplies the normalised x *after* it is cast back (HF LlamaRMSNorm / Qwen3RMSNorm, which
    matters in bf16), an fp32 weight multiplies before the one final cast (HF DeepseekV4RMSNorm).
    """
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * h.to(torch.promote_types(x.dtype, weight.dtype))).to(x.dtype)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last axis, as HF's DeepseekV4UnweightedRMSNorm rounds it: the statistic in
    fp32, its reciprocal root cast to x's dtype, and the product taken in x's dtype."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the residual sum is kept in x's dtype, as HF does."""
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


class NativeNorm(NormBackend):
    name = "native"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return add_rms_norm(x, residual, weight, eps)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)
