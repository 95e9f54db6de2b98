"""Linear family: GEMMs on plain or quantized weights."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from .norm import NormBackend


@dataclass
class LinearWeight:
    """A weight [N, K] and how it is stored.

    ``scheme``: "dense" (bf16/fp16/fp32 ``data``), "fp8_block" (E4M3 ``data`` with fp32 ``scale``
    [ceil(N/128), ceil(K/128)], the DeepSeek-V3 scheme) or "mxfp8" (E4M3 ``data`` with E8M0
    ``scale`` [N, K/32] stored as uint8 exponents).
    """

    data: torch.Tensor
    scheme: str = "dense"
    scale: torch.Tensor | None = None
    bias: torch.Tensor | None = None

    @property
    def out_features(self) -> int:
        return int(self.data.shape[0])


class LinearBackend(ABC):
    name: str = "?"
    schemes: tuple[str, ...] = ("dense",)

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx

    @abstractmethod
    def apply(self, x: torch.Tensor, w: LinearWeight) -> torch.Tensor:
        """x [..., K] @ w.T -> [..., N] in x's dtype."""

    # A GEMM and the elementwise op before or after it, which a backend may run as one launch; where
    # it does not, the norm family's backend (``ops``) runs the op.

    def norm_linear(self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                    w: LinearWeight, ops: NormBackend, silu_mul: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(``apply``, or with ``silu_mul`` ``gate_up_silu``, of rms_norm(x + residual) with w;
        x + residual): a decoder layer's input norm and the projection it feeds. Without a residual
        the norm is of x, and x is the sum."""
        if residual is None:
            h, summed = ops.rms_norm(x, norm_weight, eps), x
        else:
            h, summed = ops.add_rms_norm(x, residual, norm_weight, eps)
        return (self.gate_up_silu(h, w, ops) if silu_mul else self.apply(h, w)), summed

    def gate_up_silu(self, x: torch.Tensor, w: LinearWeight, ops: NormBackend) -> torch.Tensor:
        """silu_and_mul(apply(x, w)) for a gate/up projection w [2I, K], so the [.., 2I] product
        need never reach memory."""
        return ops.silu_and_mul(self.apply(x, w))
