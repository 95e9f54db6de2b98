"""Linear family: GEMMs on plain or quantized weights."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from ..native.quant import dequantize_fp8_block, dequantize_mxfp8
from .norm import NormBackend

MX_BLOCK = 32  # values per E8M0 scale in MXFP8
FP8_BLOCKS = (128, 32)  # square block edges of "fp8_block" weights: DeepSeek-V3/V4's, DeepSeek-V4.1's


def fp8_block_edge(shape: tuple[int, ...], scale_shape: tuple[int, ...]) -> int:
    """The edge of the square blocks that a scale of ``scale_shape`` covers in a weight of ``shape``
    [N, K]: one of ``FP8_BLOCKS``. Where several fit (N and K within the smallest), one block holds the
    whole weight and the first is as right as any."""
    n, k = shape
    for block in FP8_BLOCKS:
        if tuple(scale_shape) == (math.ceil(n / block), math.ceil(k / block)):
            return block
    raise ValueError(f"a block scale {list(scale_shape)} fits no square blocks of {list(FP8_BLOCKS)} "
                     f"over a weight [{n}, {k}]")


@dataclass
class LinearWeight:
    """A weight [N, K] and how it is stored.

    ``scheme``: "dense" (bf16/fp16/fp32 ``data``), "fp8_block" (E4M3 ``data`` with fp32 ``scale``
    [ceil(N/B), ceil(K/B)], the DeepSeek-V3 scheme with B = 128, DeepSeek-V4.1's with B = 32: the
    scale's shape says which, ``block``) or "mxfp8" (E4M3 ``data`` with E8M0 ``scale`` [N, K/32]
    stored as uint8 exponents).
    """

    data: torch.Tensor
    scheme: str = "dense"
    scale: torch.Tensor | None = None
    bias: torch.Tensor | None = None

    @property
    def out_features(self) -> int:
        return int(self.data.shape[0])

    @property
    def block(self) -> int:
        """An "fp8_block" weight's block edge, from its scale's shape."""
        if self.scheme != "fp8_block" or self.scale is None:
            raise ValueError(f"a {self.scheme!r} weight{'' if self.scale is not None else ' without a scale'} "
                             f"has no block edge")
        return fp8_block_edge(tuple(self.data.shape), tuple(self.scale.shape))


def weight_values(w: LinearWeight, dtype: torch.dtype) -> torch.Tensor:
    """The [N, K] weight in ``dtype`` that ``w`` stands for, dequantized from its scheme."""
    if w.scheme == "dense":
        return w.data.to(dtype)
    if w.scale is None:
        raise ValueError(f"a {w.scheme!r} weight needs its scale")
    if w.scheme == "fp8_block":
        return dequantize_fp8_block(w.data, w.scale, w.block, dtype)
    if w.scheme == "mxfp8":
        return dequantize_mxfp8(w.data, w.scale, dtype=dtype)
    raise ValueError(f"a weight's scheme is dense, fp8_block or mxfp8, not {w.scheme!r}")


@dataclass(frozen=True)
class MXFP8Tensor:
    """Activations a kernel's epilogue already wrote as MXFP8 for the GEMM that reads them: E4M3
    ``data`` [..., K] and one E8M0 exponent per 32 along K in ``scale`` [..., K/32] (uint8), as
    core/native/quant.py's ``quantize_mxfp8`` makes them. ``dtype`` is what the values were before:
    the dtype that GEMM returns."""

    data: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def reshape(self, *shape: int) -> MXFP8Tensor:
        """The same values as ``data.reshape(shape)``; each block of 32 stays within a row, so the new
        last axis must be a multiple of 32 too (the old one is)."""
        data = self.data.reshape(*shape)
        if data.shape[-1] % MX_BLOCK:
            raise ValueError(f"MXFP8 rows of {data.shape[-1]} values would split blocks of {MX_BLOCK}")
        return MXFP8Tensor(data, self.scale.reshape(*data.shape[:-1], data.shape[-1] // MX_BLOCK), self.dtype)

    def dequantize(self) -> torch.Tensor:
        return dequantize_mxfp8(self.data, self.scale, self.dtype)


class LinearBackend(ABC):
    name: str = "?"
    schemes: tuple[str, ...] = ("dense",)
    fp8_blocks: tuple[int, ...] = (128,)  # the block edges of "fp8_block" weights it multiplies

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx

    @abstractmethod
    def apply(self, x: torch.Tensor, w: LinearWeight) -> torch.Tensor:
        """x [..., K] @ w.T -> [..., N] in x's dtype."""

    def logits(self, x: torch.Tensor, w: LinearWeight) -> torch.Tensor:
        """An LM head: ``apply`` (its values rounded to x's dtype) as fp32 logits [..., N], which the
        sampler reads; a backend may write them in fp32 from its product, so the cast costs no launch."""
        return self.apply(x, w).float()

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

    def grouped(self, x: torch.Tensor, w: LinearWeight) -> torch.Tensor:
        """x [T, G, K] times each group's [R, K] block of a dense or "fp8_block" weight [G * R, K]
        (rounded to x's dtype) -> [T, G * R] in x's dtype: DeepSeek-V4's grouped output projection,
        here one bmm."""
        if w.scheme not in ("dense", "fp8_block"):
            raise ValueError(f"a grouped product takes a dense or fp8_block weight, not {w.scheme!r}")
        t, groups, k = x.shape
        b = weight_values(w, x.dtype).view(groups, -1, k).transpose(1, 2)  # [G, K, R]
        return torch.bmm(x.transpose(0, 1), b).transpose(0, 1).reshape(t, -1)

    def grouped_mxfp8(self, x: MXFP8Tensor, w: LinearWeight) -> torch.Tensor:
        """x [T, G, K] in MXFP8 times each group's [R, K] block of an "mxfp8" or "fp8_block" weight
        [G * R, K] -> [T, G * R] in x's dtype (DeepSeek-V4's grouped output projection). Here the
        definition: both dequantized exactly to fp32, multiplied there, rounded once; a backend may
        fuse the scales."""
        if w.scheme not in ("mxfp8", "fp8_block") or w.scale is None:
            raise ValueError(f"a grouped MXFP8 product needs an mxfp8 or fp8_block weight with its scale, "
                             f"not {w.scheme!r}{'' if w.scale is not None else ' without one'}")
        t, groups, k = x.shape
        a = dequantize_mxfp8(x.data, x.scale).transpose(0, 1)  # [G, T, K]
        b = weight_values(w, torch.float32).view(groups, -1, k).transpose(1, 2)  # [G, K, R]
        return torch.bmm(a, b).transpose(0, 1).reshape(t, -1).to(x.dtype)

    def projection_then_normed(self, x: torch.Tensor, first: LinearWeight, take: int, norm_weight: torch.Tensor,
                               eps: float, second: LinearWeight, ops: NormBackend) -> tuple[torch.Tensor, torch.Tensor]:
        """(``apply(x, first)``, ``norm_linear`` of its leading ``take`` columns through the RMSNorm
        ``norm_weight`` and ``second``): a projection whose first part an RMSNorm feeds to the next
        (DeepSeek-V4's attention input and its low-rank q). Here the two in turn; a backend may run
        them as one launch."""
        out = self.apply(x, first)
        return out, self.norm_linear(out[..., :take], None, norm_weight, eps, second, ops)[0]

    def low_rank_output(self, x: torch.Tensor | MXFP8Tensor, first: LinearWeight, second: LinearWeight) -> torch.Tensor:
        """DeepSeek-V4's grouped low-rank output projection, both halves: x [T, G, K] through each group's
        block of ``first`` (``grouped``; ``grouped_mxfp8`` where x is MXFP8), rounded to x's dtype,
        then through ``second`` [H, G * R] -> [T, H]. Here the two products in turn; a backend may
        run them as one launch."""
        low = self.grouped_mxfp8(x, first) if isinstance(x, MXFP8Tensor) else self.grouped(x, first)
        return self.apply(low, second)

    def gate_up_silu(self, x: torch.Tensor, w: LinearWeight, ops: NormBackend) -> torch.Tensor:
        """silu_and_mul(apply(x, w)) for a gate/up projection w [2I, K], so the [.., 2I] product
        need never reach memory."""
        return ops.silu_and_mul(self.apply(x, w))
