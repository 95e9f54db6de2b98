"""Linear family: GEMMs on plain or quantized weights."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch


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
