"""Linear layers in plain torch: quantized weights are dequantized, then multiplied in x's dtype.

Dequantizing on every call keeps this the plain definition of what a quantized GEMM computes;
the fast backends fuse the scales into the GEMM instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..families.linear import FP8_BLOCKS, LinearBackend, LinearWeight, weight_values


class NativeLinear(LinearBackend):
    name = "native"
    schemes = ("dense", "fp8_block", "mxfp8")
    fp8_blocks = FP8_BLOCKS

    def apply(self, x: torch.Tensor, w: LinearWeight) -> torch.Tensor:
        if w.scheme not in self.schemes:
            raise ValueError(f"the native linear backend has no scheme {w.scheme!r}; it has {NativeLinear.schemes}")
        bias = None if w.bias is None else w.bias.to(x.dtype)
        return F.linear(x, weight_values(w, x.dtype), bias)
