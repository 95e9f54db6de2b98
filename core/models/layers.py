"""Layers shared by the model definitions; each calls its family backend or a native op."""

from __future__ import annotations

import torch
from torch import nn

from ..families.linear import LinearBackend, LinearWeight
from ..families.norm import NormBackend
from ..native.norm import NativeNorm


def empty_param(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


def quantized_params(weight: torch.Tensor, data_dtype: torch.dtype, scale_shape: tuple[int, ...],
                     scale_dtype: torch.dtype) -> tuple[nn.Parameter, nn.Parameter]:
    """Empty (data, scale) parameters that hold ``weight``'s values quantized, to be loaded: the data
    in ``data_dtype`` and ``weight``'s shape, scales of ``scale_shape`` (the checkpoint's: a
    tensor-parallel rank holds its part, as of the weight)."""
    device, partition = weight.device, getattr(weight, "partition", None)
    if partition is not None:
        dim, _, count = partition
        scale_shape = tuple(n // count if d == dim else n for d, n in enumerate(scale_shape))
    data = empty_param(*weight.shape, dtype=data_dtype, device=device)
    scale = empty_param(*scale_shape, dtype=scale_dtype, device=device)
    if partition is not None:
        data.partition = scale.partition = partition
    scale.values_per_element = 0  # a scale stands for no weight of its own (weights.resident_bytes)
    return data, scale


class Linear(nn.Module):
    """y = x @ W.T (+ b) through the selected linear backend.

    ``shards`` names the checkpoint tensors stacked along the output rows (fused q/k/v or
    gate/up): name -> (row offset, rows). The loader writes each shard in place. A checkpoint that
    stores the weight quantized may keep it so (``keep_quantized``): ``weight`` then holds the
    quantized data and ``weight_scale`` its scales, and the backend multiplies them as they are.
    """

    def __init__(self, in_features: int, out_features: int, backend: LinearBackend, *, bias: bool = False,
                 dtype: torch.dtype, device: torch.device | str,
                 shards: dict[str, tuple[int, int]] | None = None) -> None:
        super().__init__()
        self.backend = backend
        self.weight = empty_param(out_features, in_features, dtype=dtype, device=device)
        self.bias = empty_param(out_features, dtype=dtype, device=device) if bias else None
        self.register_parameter("weight_scale", None)
        self.shards = shards or {}
        self.scheme = "dense"

    def keep_quantized(self, scheme: str, data_dtype: torch.dtype, scale_shape: tuple[int, ...],
                       scale_dtype: torch.dtype = torch.float32) -> None:
        """Hold the weight as ``scheme`` (a LinearWeight scheme): data in ``data_dtype`` and scales of
        ``scale_shape`` (the checkpoint's: a tensor-parallel rank holds its part), both empty until
        loaded. Again with the same scheme: nothing."""
        if scheme == self.scheme:
            return
        if self.scheme != "dense" or scheme not in self.backend.schemes:
            raise ValueError(f"a {self.scheme} linear cannot become {scheme} (the {self.backend.name} linear "
                             f"backend runs {self.backend.schemes})")
        self.weight, self.weight_scale = quantized_params(self.weight, data_dtype, scale_shape, scale_dtype)
        self.scheme = scheme

    @property
    def linear_weight(self) -> LinearWeight:
        return LinearWeight(self.weight, self.scheme, self.weight_scale, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.apply(x, self.linear_weight)


class RMSNorm(nn.Module):
    """``ops``: the norm backend that runs it; None: the native one."""

    def __init__(self, size: int, eps: float, *, dtype: torch.dtype, device: torch.device | str,
                 ops: NormBackend | None = None) -> None:
        super().__init__()
        self.weight = empty_param(size, dtype=dtype, device=device)
        self.eps = eps
        self.ops = ops or NativeNorm(None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Norm of x + residual, and that sum as the next residual (the first layer has none)."""
        if residual is None:
            return self(x), x
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)

    def add_linear(self, x: torch.Tensor, residual: torch.Tensor | None, linear: Linear,
                   silu_mul: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """``linear`` (a gate/up projection and its SiLU-and-mul with ``silu_mul``) of
        ``add_forward``'s norm, and the residual: the projection's backend fuses the norm (and the
        activation) where it can, and this norm's backend runs what it does not."""
        return linear.backend.norm_linear(x, residual, self.weight, self.eps, linear.linear_weight, self.ops,
                                          silu_mul)


class Embedding(nn.Module):
    def __init__(self, vocab: int, hidden: int, *, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.weight = empty_param(vocab, hidden, dtype=dtype, device=device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(ids, self.weight)
