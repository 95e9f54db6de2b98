"""RMSNorm, alone or after the residual add, one row per program in a single pass over memory; and
the norm family's Triton backend (with backends/triton/activation.py's SiLU-and-mul).

Rounding follows core/native/norm.py step for step, so the kernel and the oracle agree to the last
bit wherever they agree on the fp32 sum of squares: the residual sum is rounded to x's dtype
before it is normalised; a weight in x's dtype multiplies the normalised row after it is rounded
to x's dtype, an fp32 weight multiplies before the one final rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.core.families.norm import NormBackend

from . import activation
from .pdl import launch_options, wait_for_prior
from .target import config_for


@dataclass(frozen=True)
class NormConfig:
    elements_per_warp: int  # a warp's share of the row: 16-byte accesses per lane at 16-bit dtypes
    max_warps: int


NORM = {
    "cuda": NormConfig(elements_per_warp=256, max_warps=16),
    "hip": NormConfig(elements_per_warp=512, max_warps=16),
    "default": NormConfig(elements_per_warp=1 << 30, max_warps=1),  # the interpreter: one "warp"
}


@triton.jit
def rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
    stride_x, stride_r, stride_o, stride_ro,
    hidden, eps,
    HAS_RESIDUAL: tl.constexpr, ROUND_BEFORE_WEIGHT: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    wait_for_prior(PDL)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
    h = x.to(tl.float32)
    h = h * tl.rsqrt(tl.sum(h * h, axis=0) / hidden + eps)
    if ROUND_BEFORE_WEIGHT:
        h = h.to(x.dtype).to(tl.float32)
    h = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32) * h
    tl.store(out_ptr + row * stride_o + cols, h.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., H] as [rows, H] with unit column stride (a view where the layout allows)."""
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def _launch(x, residual, weight, eps, out, residual_out) -> None:
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight shape {tuple(weight.shape)} does not match hidden size {hidden}")
    x2, o2 = _rows(x), out.view(-1, hidden)
    r2, ro2 = (_rows(residual), residual_out.view(-1, hidden)) if residual is not None else (x2, o2)
    cfg = config_for(NORM, x.device)
    block = triton.next_power_of_2(hidden)
    num_warps = max(1, min(cfg.max_warps, block // cfg.elements_per_warp))
    rms_norm_kernel[(x2.shape[0],)](
        x2, r2, weight, o2, ro2,
        x2.stride(0), r2.stride(0), o2.stride(0), ro2.stride(0),
        hidden, eps,
        HAS_RESIDUAL=residual is not None,
        ROUND_BEFORE_WEIGHT=weight.dtype == x.dtype and x.dtype != torch.float32,
        BLOCK=block, num_warps=num_warps, **launch_options(x.device),
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """x / rms(x) * weight over the last axis, in x's dtype (``out``: a contiguous tensor like x)."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
    _launch(x, None, weight, eps, out, None)
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 out: torch.Tensor | None = None,
                 residual_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), the sum in x's dtype; the outputs may alias the inputs."""
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must match x "
                         f"{tuple(x.shape)} {x.dtype}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
    residual_out = torch.empty_like(out) if residual_out is None else residual_out
    _launch(x, residual, weight, eps, out, residual_out)
    return out, residual_out


class TritonNorm(NormBackend):
    name = "triton"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return add_rms_norm(x, residual, weight, eps)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return activation.silu_and_mul(x)
