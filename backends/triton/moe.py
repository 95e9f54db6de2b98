"""MoE on Triton: routing in one kernel (moe_routing.py), the experts through the fused grouped GEMMs.

Grouped top-k (DeepSeek-V3) keeps the native routing, torch ops without a host synchronisation.
Neither path reads a device value on the host, so routing and experts can be captured in a graph.
"""

from __future__ import annotations

import torch

from engine.core.families.moe import ExpertWeights, MoEBackend, RoutingConfig
from engine.core.native.moe import NativeMoE

from . import moe_routing
from .fused_moe import fused_moe


class TritonMoE(MoEBackend):
    name = "triton"
    schemes = ("dense", "fp8_block", "fp4")

    def route(self, router_logits: torch.Tensor, cfg: RoutingConfig,
              input_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if cfg.num_groups > 1:
            return NativeMoE.route(self, router_logits, cfg, input_ids)
        return moe_routing.route(router_logits, cfg, input_ids)

    def experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w: ExpertWeights,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """As ``NativeMoE.experts``, written into ``out`` [T, H] where given; the scheme travels in the
        weights' dtypes (E4M3 for fp8_block, packed uint8 for fp4)."""
        if w.scheme not in self.schemes:
            raise ValueError(f"expert scheme {w.scheme!r} is not supported; supported: {self.schemes}")
        return fused_moe(x, weights, ids, w.gate_up, w.down, activation=w.activation, swiglu_limit=w.swiglu_limit,
                         gate_up_scale=w.gate_up_scale, down_scale=w.down_scale, out=out)
