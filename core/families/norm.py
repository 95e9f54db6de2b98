"""Norm family: RMSNorm, residual add + RMSNorm, and SiLU-and-mul, the elementwise ops between
GEMMs.

Each reads and writes a whole activation once, so a backend runs each as one launch instead of the
handful of torch ops the native definitions (core/native/norm.py, activation.py) take. A linear
backend may still fold a norm into a GEMM's prologue or the activation into its epilogue
(``LinearBackend.norm_linear``, ``gate_up_silu``); this family runs them everywhere else.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch


class NormBackend(ABC):
    name: str = "?"
    graph_safe: bool = True

    def __init__(self, ctx: Any) -> None:  # ctx: registry.SelectionContext
        self.ctx = ctx

    @abstractmethod
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x / rms(x) * weight over the last axis, in x's dtype, rounded as core/native/norm.py rounds."""

    @abstractmethod
    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(x + residual), x + residual), the sum in x's dtype."""

    @abstractmethod
    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """[..., 2I] (gate, then up) -> silu(gate) * up [..., I]."""
