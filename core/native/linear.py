"""Linear layers in plain torch: quantized weights are dequantized, then multiplied in x's dtype.

Dequantizing on every call keeps this the plain definition of what a quantized GEMM computes;
the fast backends fuse the scales into the GEMM instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..families.linear import FP8_BLOCKS, LinearBackend, LinearWeight
from .quant import dequantize_fp8_block, dequantize_mxfp8


class NativeLinear(LinearBackend):
    name = "native"
    schemes = ("dense", "fp8_block", "mxfp8")
    fp8_blocks = FP8_BLOCKS

    def apply(self, x: torch.Tensor, w: LinearWeight) -> torch.Tensor:
        bias = None if w.bias is None else w.bias.to(x.dtype)
        return F.linear(x, self.weight(w, x.dtype), bias)

    @staticmethod
    def weight(w: LinearWeight, dtype: torch.dtype) -> torch.Tensor:
        """The [N, K] weight in ``dtype`` that ``w`` stands for."""
        if w.scheme == "dense":
            return w.data.to(dtype)
        if w.scale is None:
            raise ValueError(f"a {w.scheme!r} weight needs its scale")
        if w.scheme == "fp8_block":
            return dequantize_fp8_block(w.data, w.scale, w.block, dtype)
        if w.scheme == "mxfp8":
            return dequantize_mxfp8(w.data, w.scale, dtype=dtype)
        raise ValueError(f"the native linear backend has no scheme {w.scheme!r}; it has {NativeLinear.schemes}")
