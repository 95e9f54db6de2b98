"""Llama, Qwen3 and Qwen3-MoE checkpoints in the fine-grained FP8 layout, kept resident as stored.

The published layout (Qwen's ``*-FP8`` checkpoints, HF transformers' FineGrainedFP8, vLLM's block
FP8) stores every projection of the decoder layers as ``<name>.weight`` in float8_e4m3fn with one
fp32 scale per 128 x 128 block in ``<name>.weight_scale_inv`` [ceil(N/128), ceil(K/128)]
(weight = data * scale), and says so in config.json::

    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": [128, 128]}

It is DeepSeek-V3's FP8 format, so the pairing of weights with scales is DeepSeek's reader
(deepseek_v4/checkpoint.py). A projection whose linear backend runs ``fp8_block`` keeps the E4M3
data and scales (the fused q/k/v and gate/up too, when every part fills whole 128-row blocks), as
does an expert stack whose MoE backend runs it; the rest is dequantized to the model's dtype at
load, as everything is under ``--quantization none``. Activations are quantized per token and 128
channels by the backends that multiply in E4M3 ("dynamic"); a config asking for anything else is
refused at start-up, naming the field.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from typing import Iterable, Iterator

import torch
from torch import nn

from ..native.quant import FP8
from .deepseek_v4.checkpoint import BLOCK, SCALE, Quantized, paired
from .experts import ExpertStack
from .layers import Linear
from .weights import Target, WeightLoadError

logger = logging.getLogger(__name__)

SCHEME = "fp8_block"
DATA_PARAMS = ("weight", "gate_up", "down")  # the parameters of a Linear or an expert stack that hold weights


def check_config(hf: dict) -> bool:
    """Whether config.json names the fine-grained FP8 layout; anything else it names under
    ``quantization_config`` is refused, naming the field."""
    q = hf.get("quantization_config")
    if not q:
        return False
    expected = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [BLOCK, BLOCK]}
    for field, want in expected.items():
        got = q.get(field, want if field in ("fmt", "activation_scheme") else None)
        if got != want and not (isinstance(got, (list, tuple)) and list(got) == want):
            raise ValueError(f"quantization_config.{field} is {got!r}; this engine reads Llama/Qwen3 checkpoints "
                             f"quantized as {expected} (fine-grained FP8), or unquantized ones")
    return True


def scale_target(model: nn.Module, weight: Target) -> Target:
    """Where the scale of the weight that goes to ``weight`` goes: beside it, its rows in blocks."""
    rows = weight.rows
    if rows is not None:
        owner = model.get_submodule(weight.param.rpartition(".")[0])
        rows = owner.scale_rows(rows) if isinstance(owner, ExpertStack) else (rows[0] // BLOCK,
                                                                              math.ceil(rows[1] / BLOCK))
    return Target(weight.param + "_scale", rows=rows, expert=weight.expert, part=weight.part)


def resolve_scale(model: nn.Module, name: str) -> Target | None:
    """A scale's name (``SCALE``) -> its target; None where the model ignores its weight."""
    weight = model.resolve(SCALE.match(name)[1] + ".weight")
    return None if weight is None else scale_target(model, weight)


def _fills_blocks(linear: Linear) -> bool:
    """Whether every part of ``linear`` (each stacked checkpoint tensor, each rank's slice) starts
    on a 128-row block and its scales are therefore rows of one scale tensor."""
    parts = list(linear.shards.values())
    if any(offset % BLOCK for offset, _ in parts) or any(rows % BLOCK for _, rows in parts[:-1]):
        return False
    split = [p for p in getattr(linear, "parts", {}).values() if p[2] > 1]
    if split and any(rows % BLOCK for _, rows in parts):
        return False
    partition = getattr(linear.weight, "partition", None)
    return partition is None or partition[2] == 1 or linear.weight.shape[partition[0]] % BLOCK == 0


def _kind(owner: nn.Module | None) -> str:
    return "experts" if isinstance(owner, ExpertStack) else "linears"


class BlockFP8Weights:
    """Turns a checkpoint's (name, tensor) stream into what the model's parameters take: each FP8
    weight kept with its fp32 scales where its layer can, else dequantized; counts both."""

    def __init__(self, model: nn.Module, resident: bool, dtype: torch.dtype, moe_schemes: tuple[str, ...]) -> None:
        self.model, self.resident, self.dtype, self.moe_schemes = model, resident, dtype, moe_schemes
        self.kept, self.dequantized = Counter(), Counter()
        self.dense: set[str] = set()  # layers that already took an unquantized weight

    def __call__(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for item in paired(weights):
            if isinstance(item, Quantized):
                if item.kind != "fp8" or item.block != (BLOCK, BLOCK):
                    raise ValueError(f"checkpoint tensor {item.name!r} is {item.kind} in blocks of {item.block}; "
                                     f"the fine-grained FP8 layout stores E4M3 in {BLOCK}x{BLOCK} blocks")
                owner = self._owner(item.name)
                if self.resident and owner is not None and self._keep(owner, item):
                    self.kept[_kind(owner)] += 1
                    yield item.name, item.data
                    yield item.scale_name, item.float_scale()
                    continue
                self.dequantized[_kind(owner)] += 1
                item = (item.name, item.dequantize(self.dtype))
            name, tensor = item
            self._check_dense(name)
            yield name, tensor

    def log(self) -> None:
        logger.info("FP8 block-scaled weights: kept as stored %s, dequantized at load %s%s", dict(self.kept),
                    dict(self.dequantized), " (--quantization none)" if not self.resident else "")

    def _owner(self, name: str) -> nn.Module | None:
        target = self.model.resolve(name)
        if target is None:
            return None
        try:
            return self.model.get_submodule(target.param.rpartition(".")[0])
        except AttributeError:
            return None  # not a parameter of this model: load_into names it

    def _keep(self, owner: nn.Module, q: Quantized) -> bool:
        """Switch ``owner`` to E4M3 with block scales, if it and its backend run them and it has
        taken no unquantized weight yet."""
        path = self.model.resolve(q.name).param.rpartition(".")[0]
        if path in self.dense:
            return False
        if isinstance(owner, ExpertStack):
            if not owner.can_keep(SCHEME, self.moe_schemes):
                return False
            owner.keep_quantized(SCHEME)
            return True
        if not isinstance(owner, Linear) or SCHEME not in owner.backend.schemes or not _fills_blocks(owner):
            return False
        n, k = owner.weight.shape
        shape = [math.ceil(n / BLOCK), math.ceil(k / BLOCK)]
        partition = getattr(owner.weight, "partition", None)
        if partition is not None:  # keep_quantized takes the checkpoint's scale shape and cuts its part
            shape[partition[0]] *= partition[2]
        owner.keep_quantized(SCHEME, FP8, tuple(shape))
        return True

    def _check_dense(self, name: str) -> None:
        """Record a layer that takes an unquantized weight; one already kept in E4M3 cannot."""
        target = self.model.resolve(name)
        if target is None:
            return
        path, _, leaf = target.param.rpartition(".")
        if leaf not in DATA_PARAMS:
            return
        try:
            owner = self.model.get_submodule(path)
        except AttributeError:
            return  # not a parameter of this model: load_into names it
        if getattr(owner, "scheme", "dense") != "dense":
            raise WeightLoadError(f"checkpoint tensor {name!r} is unquantized, but {path!r} holds FP8 parts of "
                                  f"the same projection; a fused projection's parts are stored in one format")
        self.dense.add(path)
