"""A stack of experts' weights in one tensor per projection, as the MoE family computes them."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..families.moe import ExpertWeights
from ..native.quant import FP8
from .layers import empty_param
from .weights import Target

FP8_BLOCK = 128
FP4_GROUP = 32


class ExpertStack(nn.Module):
    """Stacked expert weights, ``gate_up`` [E, 2I, H] (gate rows first) and ``down`` [E, H, I], dense
    or kept in a quantized scheme of ``ExpertWeights`` with ``gate_up_scale`` and ``down_scale``.

    Under tensor or expert parallelism a rank holds part of a layer's experts (``placement``,
    core/distributed/moe.py): experts ``first`` .. ``first + count - 1`` of the checkpoint, each with
    part ``index`` of ``parts`` of its intermediate rows (I is then the local share)."""

    def __init__(self, count: int, hidden: int, inter: int, *, dtype: torch.dtype, device, first: int = 0,
                 split: tuple[int, int] = (0, 1)) -> None:
        super().__init__()
        inter = inter // split[1]
        self.gate_up = empty_param(count, 2 * inter, hidden, dtype=dtype, device=device)
        self.down = empty_param(count, hidden, inter, dtype=dtype, device=device)
        self.register_parameter("gate_up_scale", None)
        self.register_parameter("down_scale", None)
        self.scheme, self.inter, self.block = "dense", inter, FP8_BLOCK
        self.first, self.split = first, split

    def target(self, prefix: str, which: str, expert: int) -> Target | None:
        """Where checkpoint expert ``expert``'s ``which`` ("gate", "up" or "down") goes in the stack
        named ``prefix``; None for an expert another rank holds."""
        local = expert - self.first
        if not 0 <= local < self.gate_up.shape[0]:
            return None
        index, parts = self.split
        if which == "down":
            return Target(f"{prefix}.down", expert=local, part=(1, index, parts))
        rows = (0, self.inter) if which == "gate" else (self.inter, self.inter)
        return Target(f"{prefix}.gate_up", rows=rows, expert=local, part=(0, index, parts))

    def can_keep(self, scheme: str, schemes: tuple[str, ...], block: int = FP8_BLOCK) -> bool:
        """Whether this stack can hold ``scheme`` (the backend runs ``schemes``), FP8 in square blocks
        of ``block`` (128; DeepSeek-V4.1's 32), which must not straddle the gate and up halves."""
        if scheme == self.scheme:
            return scheme != "fp8_block" or block == self.block
        return self.scheme == "dense" and scheme in schemes and (scheme != "fp8_block" or self.inter % block == 0)

    def keep_quantized(self, scheme: str, block: int = FP8_BLOCK) -> None:
        """Hold the weights as ``scheme`` ("fp8_block" in square blocks of ``block``, or "fp4"), empty
        until loaded."""
        if scheme == self.scheme:
            return
        (count, two_inner, hidden), inner, device = self.gate_up.shape, self.inter, self.gate_up.device
        if scheme == "fp4":
            data_dtype, scale_dtype, packing = torch.uint8, torch.uint8, 2
            scales = {"gate_up": (count, two_inner, hidden // FP4_GROUP), "down": (count, hidden, inner // FP4_GROUP)}
        elif scheme == "fp8_block":
            data_dtype, scale_dtype, packing = FP8, torch.float32, 1
            scales = {"gate_up": (count, two_inner // block, math.ceil(hidden / block)),
                      "down": (count, math.ceil(hidden / block), math.ceil(inner / block))}
            self.block = block
        else:
            raise ValueError(f"expert scheme {scheme!r} is neither fp8_block nor fp4")
        for name, scale_shape in scales.items():
            *rows, k = getattr(self, name).shape
            data = empty_param(*rows, k // packing, dtype=data_dtype, device=device)
            data.values_per_element = packing
            scale = empty_param(*scale_shape, dtype=scale_dtype, device=device)
            scale.values_per_element = 0  # bytes, but no weights of their own (weights.resident_bytes)
            setattr(self, name, data)
            setattr(self, f"{name}_scale", scale)
        self.scheme = scheme

    def scale_rows(self, rows: tuple[int, int]) -> tuple[int, int]:
        """The rows of ``gate_up_scale`` that hold the scales of weight rows (offset, count)."""
        if self.scheme == "fp8_block":
            return rows[0] // self.block, math.ceil(rows[1] / self.block)
        return rows

    def weights(self, activation: str, swiglu_limit: float | None) -> ExpertWeights:
        return ExpertWeights(self.gate_up, self.down, activation=activation, swiglu_limit=swiglu_limit,
                             scheme=self.scheme, gate_up_scale=self.gate_up_scale, down_scale=self.down_scale)
