"""Linear layers on Triton GEMMs: the same contract as the native backend, quantized weights
multiplied in their stored format instead of dequantized first.

Dense products of one row (decode at batch 1) run the GEMV kernel, which on an H200 ran at 1.35x of
cuBLAS by geometric mean over the Llama-8B and Qwen3-0.6B projections (benchmarks/gemv_bench.py,
graph-timed); a gate/up projection there fuses its SiLU-and-mul, and one fed by an RMSNorm (a
decoder layer's input norm, DeepSeek-V4's q_norm) computes that norm (and the residual add before
it) in its prologue where the rows are short enough (``gemv.NORM_MAX_K``). More rows go to the
library GEMM: at 4 and 8 rows the GEMV's tensor-core variant ran at 0.96x of cuBLAS; a projection
fed by a norm keeps the GEMV up to ``gemv.MAX_ROWS`` rows, where the norm's launch it saves
outweighs that (not measured). Block-FP8 weights (128 or 32 blocks) take the GEMV up to
``gemv.MAX_ROWS`` rows in every entry point: the E4M3 weight read as it is stored, dequantized in
registers as native dequantizes it, times unquantized x, one launch with the norm and the SiLU-mul
fused as for bf16, and through DeepSeek-V4's chained projections and its output projection's wo_b
(and V4.1's block-FP8 wo_a) in their one launch too (not yet timed on a GPU). Past that the norm
goes into the activations' quantization (each of its programs reads its rows whole for the
statistic), so norm, quantize and GEMM are two launches. The activations of quantized schemes in
the GEMMs are quantized to the weight's format on the way in
(per token and the weight's block edge, 128 or 32, for fp8_block, MXFP8 for mxfp8), so the E4M3
tensor cores see both operands; this is the one numerical difference from the native backend,
which multiplies unquantized x, as the GEMV does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.core.families.linear import FP8_BLOCKS, LinearBackend, LinearWeight, MXFP8Tensor
from engine.core.families.norm import NormBackend

from . import gemv, gemv_chain, low_rank_output
from .fp8_gemm import fp8_block_gemm, fp8_block_grouped_gemm, fp8_block_linear
from .fp8_quant import quantize_fp8_token_group
from .mxfp8 import grouped_gemm, mxfp8_grouped_gemm, mxfp8_linear

QUANTIZED = {"fp8_block": fp8_block_linear, "mxfp8": mxfp8_linear}


class TritonLinear(LinearBackend):
    name = "triton"
    schemes = ("dense", *QUANTIZED)
    fp8_blocks = FP8_BLOCKS  # 32-blocks in K steps of 32 (fp8_gemm.py)
    gemv_devices: tuple[str, ...] = ("cuda",)  # the interpreter keeps F.linear (a launch count adds "cpu")

    def apply(self, x: torch.Tensor, w: LinearWeight) -> torch.Tensor:
        if self._gemv_serves(x, w):
            return gemv.gemv(x, w.data, w.bias, scale=w.scale)
        if w.scheme == "dense":
            return F.linear(x, w.data.to(x.dtype), None if w.bias is None else w.bias.to(x.dtype))
        if w.scheme not in QUANTIZED:
            raise ValueError(f"the triton linear backend has no scheme {w.scheme!r}; it has {self.schemes}")
        if w.scale is None:
            raise ValueError(f"a {w.scheme!r} weight needs its scale")
        return QUANTIZED[w.scheme](x, w.data, w.scale, w.bias)

    def logits(self, x: torch.Tensor, w: LinearWeight) -> torch.Tensor:
        if self._gemv_serves(x, w):
            return gemv.gemv(x, w.data, w.bias, scale=w.scale, out_dtype=torch.float32)  # rounded to x's dtype, stored as fp32
        return super().logits(x, w)

    def grouped(self, x: torch.Tensor, w: LinearWeight) -> torch.Tensor:
        if w.scheme == "fp8_block" and w.scale is not None:  # x quantized per token and the weight's block edge
            data, scale = quantize_fp8_token_group(x, group=w.block)
            return fp8_block_grouped_gemm(data, scale, w.data, w.scale, x.dtype)
        if w.scheme != "dense" or w.data.dtype != x.dtype:
            return super().grouped(x, w)  # which names what is wrong, or rounds the weight to x's dtype
        return grouped_gemm(x, w.data)

    def grouped_mxfp8(self, x: MXFP8Tensor, w: LinearWeight) -> torch.Tensor:
        if w.scheme == "fp8_block" and w.scale is not None:  # K steps of 32, x's E8M0 scale and the block's
            return fp8_block_grouped_gemm(x.data, x.scale, w.data, w.scale, x.dtype)
        if w.scheme != "mxfp8" or w.scale is None:
            return super().grouped_mxfp8(x, w)  # which names what is wrong
        return mxfp8_grouped_gemm(x.data, x.scale, w.data, w.scale, x.dtype)

    def projection_then_normed(self, x: torch.Tensor, first: LinearWeight, take: int, norm_weight: torch.Tensor,
                               eps: float, second: LinearWeight, ops: NormBackend) -> tuple[torch.Tensor, torch.Tensor]:
        if ({first.scheme, second.scheme} <= {"dense", "fp8_block"} and first.bias is None and second.bias is None
                and self._gemv_serves(x, first, gemv.MAX_ROWS)
                and gemv_chain.fits(x, first.data, take, norm_weight, second.data, first.scale, second.scale)):
            return gemv_chain.gemv_chain(x, first.data, take, norm_weight, eps, second.data, first.scale,
                                         second.scale)
        return super().projection_then_normed(x, first, take, norm_weight, eps, second, ops)

    def low_rank_output(self, x: torch.Tensor | MXFP8Tensor, first: LinearWeight, second: LinearWeight) -> torch.Tensor:
        mx = isinstance(x, MXFP8Tensor)
        t, groups = x.shape[0], x.shape[1]
        if (x.data.device.type in self.gemv_devices
                and second.scheme in ("dense", "fp8_block")
                and second.bias is None and first.bias is None
                and first.scheme in (("mxfp8",) if mx else ("dense", "fp8_block"))
                and low_rank_output.refusal(t, mx, first.data, first.scale, second.data, second.scale, x.dtype,
                                            groups) is None):
            return low_rank_output.low_rank_output(x.data if mx else x, x.scale if mx else None, first.data,
                                                   first.scale, second.data, x.dtype, second.scale)
        return super().low_rank_output(x, first, second)

    def gate_up_silu(self, x: torch.Tensor, w: LinearWeight, ops: NormBackend) -> torch.Tensor:
        if w.bias is None and self._gemv_serves(x, w):
            return gemv.gemv(x, w.data, silu_mul=True, scale=w.scale)
        return ops.silu_and_mul(self.apply(x, w))

    def norm_linear(self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                    w: LinearWeight, ops: NormBackend, silu_mul: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        if not gemv.norm_fits(x):
            return super().norm_linear(x, residual, norm_weight, eps, w, ops, silu_mul)
        if w.bias is None and self._gemv_serves(x, w, gemv.MAX_ROWS):
            return gemv.norm_gemv(x, residual, norm_weight, eps, w.data, silu_mul=silu_mul, scale=w.scale)
        if w.scheme == "fp8_block" and w.scale is not None and residual is None:
            k = x.shape[-1]
            data, scale = quantize_fp8_token_group(x.reshape(-1, k), group=w.block, norm=(norm_weight, eps))
            out = fp8_block_gemm(data, scale, w.data, w.scale, x.dtype, w.bias).view(*x.shape[:-1], -1)
            return (ops.silu_and_mul(out) if silu_mul else out), x
        return super().norm_linear(x, residual, norm_weight, eps, w, ops, silu_mul)

    def _gemv_serves(self, x: torch.Tensor, w: LinearWeight, rows: int = 1) -> bool:
        """On a GPU, for 1 to ``rows`` rows of x in a dense weight's own dtype, or for as many rows
        as the GEMV takes of a block-FP8 weight (whose alternative is two launches, one a GEMM of
        64-row tiles)."""
        if w.scheme == "fp8_block":
            rows, served = gemv.MAX_ROWS, w.scale is not None and x.dtype in gemv.FLOATS
        else:
            served = w.scheme == "dense" and x.dtype == w.data.dtype
        return (served and x.device.type in self.gemv_devices and 0 < x.numel() <= rows * x.shape[-1]
                and gemv.fits(x, w.data))
