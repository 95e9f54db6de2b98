"""DeepSeek-V4 MoE: routed experts (no-aux top-k, or hash routing by token id) plus one shared expert.

Both kinds of expert use V4's clamped SwiGLU. The shared expert runs through the MoE backend as a
single expert every token takes with weight 1.
"""

from __future__ import annotations

import torch
from torch import nn

from ...families.linear import LinearWeight
from ...families.moe import ExpertWeights, RoutingConfig
from ..base import Backends
from ..layers import empty_param


class SparseMoE(nn.Module):
    def __init__(self, hf: dict, hashed: bool, backends: Backends, *, dtype: torch.dtype, device) -> None:
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
        self.experts = nn.Module()
        self.experts.gate_up = empty_param(experts, 2 * inter, hidden, dtype=dtype, device=device)
        self.experts.down = empty_param(experts, hidden, inter, dtype=dtype, device=device)
        self.shared_experts = nn.Module()
        self.shared_experts.gate_up = empty_param(1, 2 * inter, hidden, dtype=dtype, device=device)
        self.shared_experts.down = empty_param(1, hidden, inter, dtype=dtype, device=device)
        self.hashed, self.intermediate = hashed, inter
        self.num_experts, self.top_k = experts, hf["num_experts_per_tok"]
        self.scoring = hf.get("scoring_func", "sqrtsoftplus")
        self.scaling = float(hf.get("routed_scaling_factor", 1.0))
        self.limit = hf.get("swiglu_limit")
        self.activation = hf.get("hidden_act", "silu")
        self.backend, self.linear = backends.moe, backends.linear

    def routing(self) -> RoutingConfig:
        # the reference always renormalises the chosen weights, whatever norm_topk_prob says
        return RoutingConfig(num_experts=self.num_experts, top_k=self.top_k, scoring=self.scoring, renormalize=True,
                             routed_scaling_factor=self.scaling,
                             correction_bias=None if self.hashed else self.gate.bias,
                             hash_table=self.gate.tid2eid if self.hashed else None)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        logits = self.linear.apply(x, LinearWeight(self.gate.weight))
        weights, ids = self.backend.route(logits, self.routing(), input_ids)
        weights = weights.to(x.dtype).float()  # the reference weighs expert outputs in x's dtype
        routed = self.backend.experts(x, weights, ids, self._weights(self.experts))
        ones = torch.ones(x.shape[0], 1, dtype=torch.float32, device=x.device)
        zeros = torch.zeros(x.shape[0], 1, dtype=torch.int64, device=x.device)
        return routed + self.backend.experts(x, ones, zeros, self._weights(self.shared_experts))

    def _weights(self, experts: nn.Module) -> ExpertWeights:
        return ExpertWeights(experts.gate_up, experts.down, activation=self.activation, swiglu_limit=self.limit)
