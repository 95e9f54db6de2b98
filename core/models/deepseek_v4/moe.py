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

import torch
from torch import nn

from ...families.moe import Router, RoutingConfig
from ..base import Backends
from ..experts import ExpertStack
from ..layers import empty_param

FOLD_SHARED = True


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
        # which experts (and which share of each) this rank holds, and how tokens reach them
        self.placement = backends.experts()
        fold_shared = fold_shared and self.placement.folds_shared
        first, count, split = self.placement.place(experts, inter)
        self.experts = ExpertStack(count + (1 if fold_shared else 0), hidden, inter, dtype=dtype, device=device,
                                   first=first, split=split)
        self.shared_experts = None if fold_shared else ExpertStack(1, hidden, inter, dtype=dtype, device=device,
                                                                   split=self.placement.shared_split)
        self.hashed, self.folded = hashed, fold_shared
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
        return self.placement(self, x, input_ids)

    def route(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Weights and ids [T, top_k + 1]: the shared expert last."""
        return self.backend.route(self.router().logits(x), self.routing(x.dtype), input_ids)

    def router(self) -> Router:
        return Router(self.gate.weight, self.linear)

    def route_and_combine(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """The backend projects, routes and runs both stacks in one call (the shared one folded or apart)."""
        shared = None if self.folded else self.shared_experts.weights(self.activation, self.limit)
        return self.backend.route_experts(x, self.router(), self.routing(x.dtype),
                                          self.experts.weights(self.activation, self.limit), input_ids, shared)

    def routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.backend.experts(x, weights, ids, self.experts.weights(self.activation, self.limit))

    def shared(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.backend.experts(x, weights, ids, self.shared_experts.weights(self.activation, self.limit))

    def combined(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if self.folded:
            return self.routed(x, weights, ids)
        k = self.top_k
        return self.routed(x, weights[:, :k], ids[:, :k]) + self.shared(x, weights[:, k:], ids[:, k:])
