"""DeepSeek-V4's published checkpoint layout: each quantized weight paired with its scale and checked.

DeepSeek ships the dense linears as ``<name>.weight`` in float8_e4m3fn with one E8M0 scale per
128x128 block in ``<name>.scale`` [ceil(N/128), ceil(K/128)], and the routed experts as packed
FP4 E2M1 (two per byte, ``<name>.weight`` [N, K/2] in int8, uint8 or float4_e2m1fn_x2) with one
E8M0 scale per 32 along K in ``<name>.scale`` [N, K/32]. HF transformers renames ``.scale`` to
``.weight_scale_inv`` and accepts fp32 block scales there too (the DeepSeek-V3 format); both names
are read here. Norms, embeddings, the router, hc parameters and whatever the checkpoint keeps in
bf16 pass through. Anything else is an error that names the tensor.

The model keeps a pair in its format where a layer and its backend run it (model.py), and
dequantizes the rest, or everything under ``--quantization none``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

from ...native.quant import (E8M0_DTYPES, FP4_PACKED_DTYPES, FP8, dequantize_fp4, dequantize_fp8_block,
                             dequantize_fp8_block_e8m0, e8m0_exponents, e8m0_to_float)

BLOCK = 128  # FP8 block edge of the published layout
V41_BLOCK = 32  # DeepSeek-V4.1's: 32 x 32 blocks, and its Engram tables one scale per 32 of a row
FP4_GROUP = 32  # FP4 elements per E8M0 scale along K
PLAIN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int16, torch.int32, torch.int64)  # tables such as the hash router's tid2eid
SCALE = re.compile(r"(.+)\.(scale|weight_scale_inv)$")


def check_quantization_config(hf: dict) -> None:
    """Refuse a config.json whose quantization this loader does not read."""
    q = hf.get("quantization_config")
    if not q:
        return
    method, block = q.get("quant_method", "fp8"), q.get("weight_block_size", [BLOCK, BLOCK])
    fmt, scale_fmt = q.get("fmt", "e4m3"), q.get("scale_fmt", "ue8m0")
    v41 = list(block) == [V41_BLOCK, V41_BLOCK] and scale_fmt == "ue8m0"
    if method != "fp8" or not (v41 or list(block) == [BLOCK, BLOCK]) or fmt != "e4m3" or scale_fmt not in (
            "ue8m0", "float"):
        raise ValueError(f"DeepSeek-V4 quantization_config {q} is not the published layout (quant_method fp8, "
                         f"fmt e4m3, weight_block_size [{BLOCK}, {BLOCK}] with scale_fmt ue8m0 or float, or "
                         f"V4.1's [{V41_BLOCK}, {V41_BLOCK}] with ue8m0)")
    expert_dtype = q.get("expert_dtype", hf.get("expert_dtype", "fp4"))
    if expert_dtype not in ("fp8", "fp4"):
        raise ValueError(f"DeepSeek-V4 expert_dtype {expert_dtype!r} is neither fp8 nor fp4")


def fp8_block(hf: dict) -> int:
    """The FP8 block edge a checked config's weights use: 128 (V4) or 32 (V4.1)."""
    return ((hf.get("quantization_config") or {}).get("weight_block_size") or [BLOCK])[0]


def _kind(name: str, tensor: torch.Tensor) -> str | None:
    """'fp8' or 'fp4' for a quantized weight, None for a tensor that passes through."""
    if tensor.dtype == FP8:
        kind = "fp8"
    elif tensor.dtype in FP4_PACKED_DTYPES:
        kind = "fp4"
    elif tensor.dtype in PLAIN_DTYPES or (tensor.dtype in INDEX_DTYPES and not name.endswith(".weight")):
        return None
    else:
        raise ValueError(f"checkpoint tensor {name!r} has dtype {tensor.dtype}, which the DeepSeek-V4 loader "
                         f"does not read (weights are fp32/bf16/fp16, float8_e4m3fn with a block scale, "
                         f"or packed FP4 with a per-{FP4_GROUP} scale)")
    if not name.endswith(".weight") or tensor.dim() != 2:
        raise ValueError(f"checkpoint tensor {name!r} is {kind} {tuple(tensor.shape)}, but only 2-D linear "
                         f"weights ('<name>.weight') are stored quantized")
    return kind


@dataclass(frozen=True)
class Quantized:
    """A quantized checkpoint weight and its scale, checked to fit each other."""

    name: str
    kind: str  # "fp8": E4M3 [N, K] with block scales; "fp4": packed E2M1 [N, K/2], one scale per 32
    data: torch.Tensor
    scale_name: str
    scale: torch.Tensor  # E8M0 (uint8 or float8_e8m0fnu), or fp32 for fp8 (DeepSeek-V3)
    block: tuple[int, int] = (BLOCK, BLOCK)  # fp8: rows x columns one scale covers

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        if self.kind == "fp4":
            return dequantize_fp4(self.data, self.scale, dtype)
        if self.scale.dtype == torch.float32:
            return dequantize_fp8_block(self.data, self.scale, BLOCK, dtype)
        return dequantize_fp8_block_e8m0(self.data, self.scale, self.block[0], dtype, cols=self.block[1])

    def float_scale(self) -> torch.Tensor:
        """The scale as fp32 (exact: E8M0 values are powers of two)."""
        return self.scale if self.scale.dtype == torch.float32 else e8m0_to_float(e8m0_exponents(self.scale))


def _checked(name: str, kind: str, data: torch.Tensor, scale_name: str, scale: torch.Tensor,
             block: int = BLOCK) -> Quantized:
    n, k = data.shape
    blocks = (block, block)
    if kind == "fp8":
        expected, dtypes = (math.ceil(n / block), math.ceil(k / block)), E8M0_DTYPES + (torch.float32,)
        what = f"{block}x{block} blocks"
        if block == V41_BLOCK and tuple(scale.shape) == (n, math.ceil(k / block)):  # V4.1's Engram table rows
            expected, blocks = (n, math.ceil(k / block)), (1, block)
    else:
        k *= 2
        expected, dtypes, what = (n, math.ceil(k / FP4_GROUP)), E8M0_DTYPES, f"one per {FP4_GROUP} along K"
    if scale.dtype not in dtypes:
        raise ValueError(f"scale {scale_name!r} of {kind} weight {name!r} has dtype {scale.dtype}; "
                         f"expected one of {', '.join(map(str, dtypes))}")
    if tuple(scale.shape) != expected:
        raise ValueError(f"scale {scale_name!r} has shape {tuple(scale.shape)}, but {kind} weight {name!r} "
                         f"[{n}, {k}] needs {expected} ({what})")
    if kind == "fp4" and k % FP4_GROUP:
        raise ValueError(f"fp4 weight {name!r} has K = {k}, not a multiple of {FP4_GROUP}")
    return Quantized(name, kind, data, scale_name, scale, blocks)


def paired(weights: Iterable[tuple[str, torch.Tensor]], block: int = BLOCK,
           ) -> Iterator[tuple[str, torch.Tensor] | Quantized]:
    """(name, tensor) of a checkpoint in the published layout -> the tensors that pass through, and
    each quantized weight with its scale as one :class:`Quantized` (FP8 in blocks of ``block``);
    order across shards does not matter."""
    waiting: dict[str, tuple[str, str, torch.Tensor]] = {}  # prefix -> quantized weight without its scale yet
    scales: dict[str, tuple[str, torch.Tensor]] = {}  # prefix -> scale without its weight yet
    for name, tensor in weights:
        if m := SCALE.match(name):
            prefix = m[1]
            if prefix in scales:
                raise ValueError(f"checkpoint has two scales for {prefix + '.weight'!r}: "
                                 f"{scales[prefix][0]!r} and {name!r}")
            if prefix in waiting:
                weight_name, kind, data = waiting.pop(prefix)
                yield _checked(weight_name, kind, data, name, tensor, block)
            else:
                scales[prefix] = (name, tensor)
            continue
        kind = _kind(name, tensor)
        if kind is None:
            if name.removesuffix(".weight") in scales and name.endswith(".weight"):
                raise ValueError(f"checkpoint tensor {name!r} is {tensor.dtype} but has a scale "
                                 f"{scales[name.removesuffix('.weight')][0]!r}; only fp8/fp4 weights take one")
            yield name, tensor
            continue
        prefix = name.removesuffix(".weight")
        if prefix in scales:
            scale_name, scale = scales.pop(prefix)
            yield _checked(name, kind, tensor, scale_name, scale, block)
        else:
            waiting[prefix] = (name, kind, tensor)
    if waiting:
        names = ", ".join(repr(w[0]) for w in list(waiting.values())[:8])
        raise ValueError(f"quantized checkpoint tensors without a scale ('<name>.scale' or "
                         f"'<name>.weight_scale_inv'): {names}")
    if scales:
        names = ", ".join(repr(s[0]) for s in list(scales.values())[:8])
        raise ValueError(f"checkpoint scales without a quantized weight: {names}")
