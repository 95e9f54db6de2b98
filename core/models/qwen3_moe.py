"""Qwen3-MoE: Qwen3 attention with a routed-expert MLP in the sparse layers."""

from __future__ import annotations

import re

import torch
from torch import nn

from ..families.moe import RoutingConfig
from ..forward import ForwardBatch
from .base import Backends
from .experts import ExpertStack
from .layers import Linear, RMSNorm
from .llama import MLP, Qwen3ForCausalLM
from .weights import Target

_EXPERT = re.compile(r"(.*)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_FUSED_EXPERTS = re.compile(r"(.*)\.mlp\.experts\.(gate_up|down)_proj$")


class SparseMoE(nn.Module):
    def __init__(self, hf: dict, backends: Backends, *, dtype: torch.dtype, device) -> None:
        super().__init__()
        hidden, inter, experts = hf["hidden_size"], hf["moe_intermediate_size"], hf["num_experts"]
        self.gate = Linear(hidden, experts, backends.linear, dtype=dtype, device=device)  # on every rank
        # which experts (and which share of each) this rank holds, and how tokens reach them
        self.placement = backends.experts()
        first, count, split = self.placement.place(experts, inter)
        self.experts = ExpertStack(count, hidden, inter, dtype=dtype, device=device, first=first, split=split)
        self.top_k = hf["num_experts_per_tok"]
        # HF rounds the routing weights to the activation dtype before combining: the route does
        self.routing = RoutingConfig(num_experts=experts, top_k=self.top_k, scoring="softmax",
                                     renormalize=bool(hf.get("norm_topk_prob", True)), weight_dtype=dtype)
        self.backend = backends.moe

    def norm_forward(self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm,
                     batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The experts of norm(x + residual), and that sum: the router and the experts both read the norm."""
        h, residual = norm.add_forward(x, residual)
        return self(h, batch), residual

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return self.placement(self, x, batch.input_ids)

    def route(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.backend.route(self.gate(x), self.routing, input_ids)

    def routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.backend.experts(x, weights, ids, self.experts.weights("silu", None))

    combined = routed  # no shared expert

    def route_and_combine(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        return self.backend.route_experts(x, self.gate(x), self.routing, self.experts.weights("silu", None), input_ids)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    blocks = Qwen3ForCausalLM.blocks + (("routed experts (softmax top-k)", "moe"),)

    def sliding_window(self, layer_id: int) -> int | None:
        hf = self.config.hf
        return hf.get("sliding_window") if hf.get("use_sliding_window") else None

    def make_mlp(self, layer_id: int, backends: Backends, *, dtype, device) -> nn.Module:
        hf = self.config.hf
        sparse = (layer_id not in (hf.get("mlp_only_layers") or []) and hf.get("num_experts", 0) > 0
                  and (layer_id + 1) % hf.get("decoder_sparse_step", 1) == 0)
        if not sparse:
            return MLP(hf["hidden_size"], hf["intermediate_size"], backends, dtype=dtype, device=device)
        if backends.moe is None:
            raise ValueError("Qwen3-MoE needs an MoE backend")
        return SparseMoE(hf, backends, dtype=dtype, device=device)

    def resolve(self, name: str) -> Target | None:
        if m := _EXPERT.match(name):
            return self.get_submodule(f"{m[1]}.mlp.experts").target(f"{m[1]}.mlp.experts", m[3], int(m[2]))
        if m := _FUSED_EXPERTS.match(name):
            if self.backends.moe_group.size > 1:
                raise ValueError(f"{name}: experts stored fused are not split over tensor-parallel ranks; "
                                 "a checkpoint with one tensor per expert and projection is")
            return Target(f"{m[1]}.mlp.experts.{'gate_up' if m[2] == 'gate_up' else 'down'}")
        return super().resolve(name)
