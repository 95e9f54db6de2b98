"""SiLU-and-mul on a fused gate/up projection: one read of [T, 2I], one write of [T, I].

Rounding follows core/native/activation.py: silu(gate) is computed in fp32 and rounded to the
activation dtype, then multiplied by up and rounded again, as the two torch ops do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .pdl import launch_options, wait_for_prior
from .target import config_for


@dataclass(frozen=True)
class ActivationConfig:
    block: int  # output columns per program
    num_warps: int


SILU_AND_MUL = {
    "cuda": ActivationConfig(block=1024, num_warps=4),
    "hip": ActivationConfig(block=2048, num_warps=4),
    "default": ActivationConfig(block=256, num_warps=1),
}


@triton.jit
def silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, inner, BLOCK: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inner
    wait_for_prior(PDL)
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + inner + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    out = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """[..., 2I] (gate first, then up) -> silu(gate) * up [..., I] in x's dtype."""
    if x.shape[-1] % 2:
        raise ValueError(f"last axis {x.shape[-1]} must hold gate and up halves of equal size")
    inner = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], inner), dtype=x.dtype, device=x.device) if out is None else out
    x2 = x.reshape(-1, x.shape[-1])
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    o2 = out.view(-1, inner)
    cfg = config_for(SILU_AND_MUL, x.device)
    block = min(cfg.block, triton.next_power_of_2(inner))
    silu_and_mul_kernel[(x2.shape[0], triton.cdiv(inner, block))](
        x2, o2, x2.stride(0), o2.stride(0), inner, BLOCK=block, num_warps=cfg.num_warps,
        **launch_options(x.device))
    return out
