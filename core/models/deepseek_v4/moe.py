"""DeepSeek-V4 MoE: routed experts (no-aux top-k, or hash routing by token id) plus one shared expert.

Both kinds of expert use V4's clamped SwiGLU. The shared expert runs through the MoE backend as an
expert every token takes with weight 1: the routing appends it to every token's choice
(``RoutingConfig.shared_expert``, its slot). With ``fold_shared`` it is stacked after the routed
experts and one launch computes both; otherwise the routing is sliced (views, read in place) into
the routed columns and the shared one, each for its own stack. Folding needs both in one format,
so a checkpoint kept in its published formats (FP4 routed, FP8 shared) runs them apart. ``FOLD_SHARED`` is the switch: benchmarks/moe_bench.py
(``fold``, H200, benchmarks/results/moe-h200.json) puts the folded launch at 0.89 of the two at one
token and 0.97-0.99 from 16 to 4096 at the V4-Flash shape, so it is on.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ...families.linear import LinearWeight
from ...families.moe import ExpertWeights, RoutingConfig
from ...native.quant import FP8
from ..base import Backends
from ..layers import empty_param

FOLD_SHARED = True
FP8_BLOCK = 128
FP4_GROUP = 32


class ExpertStack(nn.Module):
    """Stacked expert weights, ``gate_up`` [E, 2I, H] (gate rows first) and ``down`` [E, H, I], dense
    or kept in a quantized scheme of ``ExpertWeights`` with ``gate_up_scale`` and ``down_scale``."""

    def __init__(self, count: int, hidden: int, inter: int, *, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.gate_up = empty_param(count, 2 * inter, hidden, dtype=dtype, device=device)
        self.down = empty_param(count, hidden, inter, dtype=dtype, device=device)
        self.register_parameter("gate_up_scale", None)
        self.register_parameter("down_scale", None)
        self.scheme, self.inter = "dense", inter

    def can_keep(self, scheme: str, schemes: tuple[str, ...]) -> bool:
        """Whether this stack can hold ``scheme`` (the backend runs ``schemes``). FP8 blocks of 128
        rows must not straddle the gate and up halves."""
        if scheme == self.scheme:
            return True
        return self.scheme == "dense" and scheme in schemes and (scheme != "fp8_block" or self.inter % FP8_BLOCK == 0)

    def keep_quantized(self, scheme: str) -> None:
        """Hold the weights as ``scheme`` ("fp8_block" or "fp4"), empty until loaded."""
        if scheme == self.scheme:
            return
        (count, two_inner, hidden), inner, device = self.gate_up.shape, self.inter, self.gate_up.device
        if scheme == "fp4":
            data_dtype, scale_dtype, packing = torch.uint8, torch.uint8, 2
            scales = {"gate_up": (count, two_inner, hidden // FP4_GROUP), "down": (count, hidden, inner // FP4_GROUP)}
        elif scheme == "fp8_block":
            data_dtype, scale_dtype, packing = FP8, torch.float32, 1
            scales = {"gate_up": (count, two_inner // FP8_BLOCK, math.ceil(hidden / FP8_BLOCK)),
                      "down": (count, math.ceil(hidden / FP8_BLOCK), math.ceil(inner / FP8_BLOCK))}
        else:
            raise ValueError(f"expert scheme {scheme!r} is neither fp8_block nor fp4")
        for name, scale_shape in scales.items():
            *rows, k = getattr(self, name).shape
            data = empty_param(*rows, k // packing, dtype=data_dtype, device=device)
            data.values_per_element = packing
            scale = empty_param(*scale_shape, dtype=scale_dtype, device=device)
            scale.values_per_element = 0  # bytes, but no weights of their own (weights.resident_bytes)
            setattr(self, name, data)
            setattr(self, f"{name}_scale", scale)
        self.scheme = scheme

    def scale_rows(self, rows: tuple[int, int]) -> tuple[int, int]:
        """The rows of ``gate_up_scale`` that hold the scales of weight rows (offset, count)."""
        if self.scheme == "fp8_block":
            return rows[0] // FP8_BLOCK, math.ceil(rows[1] / FP8_BLOCK)
        return rows

    def weights(self, activation: str, swiglu_limit: float | None) -> ExpertWeights:
        return ExpertWeights(self.gate_up, self.down, activation=activation, swiglu_limit=swiglu_limit,
                             scheme=self.scheme, gate_up_scale=self.gate_up_scale, down_scale=self.down_scale)


class SparseMoE(nn.Module):
    def __init__(self, hf: dict, hashed: bool, backends: Backends, *, dtype: torch.dtype, device,
                 fold_shared: bool = False) -> None:
        super().__init__()
        if backends.moe is None:
            raise ValueError("DeepSeek-V4 needs an MoE backend")
        hidden, inter, experts = hf["hidden_size"], hf["moe_intermediate_size"], hf["n_routed_experts"]
        if hf.get("n_shared_experts", 1) != 1:
            raise ValueError(f"DeepSeek-V4 with {hf['n_shared_experts']} shared experts is not supported (1 is)")
        self.gate = nn.Module()  # router weight, and the no-aux correction bias or the hash table
        self.gate.weight = empty_param(experts, hidden, dtype=dtype, device=device)
        if hashed:
            self.gate.tid2eid = empty_param(hf["vocab_size"], hf["num_experts_per_tok"], dtype=torch.int64,
                                            device=device)
        else:
            self.gate.bias = empty_param(experts, dtype=torch.float32, device=device)
        self.experts = ExpertStack(experts + (1 if fold_shared else 0), hidden, inter, dtype=dtype, device=device)
        self.shared_experts = None if fold_shared else ExpertStack(1, hidden, inter, dtype=dtype, device=device)
        self.hashed, self.folded, self.intermediate = hashed, fold_shared, inter
        self.num_experts, self.top_k = experts, hf["num_experts_per_tok"]
        self.scoring = hf.get("scoring_func", "sqrtsoftplus")
        self.scaling = float(hf.get("routed_scaling_factor", 1.0))
        self.limit = hf.get("swiglu_limit")
        self.activation = hf.get("hidden_act", "silu")
        self.backend, self.linear = backends.moe, backends.linear

    def shared_slot(self) -> tuple[str, int]:
        """Where the shared expert's weights live: (stack attribute, expert index)."""
        return ("experts", self.num_experts) if self.folded else ("shared_experts", 0)

    def routing(self, dtype: torch.dtype) -> RoutingConfig:
        # the reference always renormalises the chosen weights, whatever norm_topk_prob says, and
        # weighs the expert outputs in the activations' dtype
        return RoutingConfig(num_experts=self.num_experts, top_k=self.top_k, scoring=self.scoring, renormalize=True,
                             routed_scaling_factor=self.scaling,
                             correction_bias=None if self.hashed else self.gate.bias,
                             hash_table=self.gate.tid2eid if self.hashed else None, weight_dtype=dtype,
                             shared_expert=self.shared_slot()[1])

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        logits = self.linear.apply(x, LinearWeight(self.gate.weight))
        weights, ids = self.backend.route(logits, self.routing(x.dtype), input_ids)  # the shared expert last
        experts = self.experts.weights(self.activation, self.limit)
        if self.folded:
            return self.backend.experts(x, weights, ids, experts)
        k = self.top_k
        routed = self.backend.experts(x, weights[:, :k], ids[:, :k], experts)
        return routed + self.backend.experts(x, weights[:, k:], ids[:, k:],
                                             self.shared_experts.weights(self.activation, self.limit))
