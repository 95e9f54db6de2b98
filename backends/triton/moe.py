"""MoE on Triton: the native routing, the experts through the fused grouped GEMMs.

Routing stays in torch (core/native/moe.py): it is a softmax or sigmoid and a top-k over [T, E],
a few small launches next to the expert GEMMs, and sharing it keeps the two backends choosing the
same experts. ``ExpertWeights`` carries no quantization scales, so the experts here run in the
weights' dtype; the FP8 path of ``fused_moe`` takes block scales directly.
"""

from __future__ import annotations

import torch

from engine.core.families.moe import ExpertWeights, MoEBackend, RoutingConfig
from engine.core.native.moe import NativeMoE

from .fused_moe import fused_moe


class TritonMoE(MoEBackend):
    name = "triton"

    def route(self, router_logits: torch.Tensor, cfg: RoutingConfig,
              input_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return NativeMoE.route(self, router_logits, cfg, input_ids)

    def experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w: ExpertWeights,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """As ``NativeMoE.experts``, written into ``out`` [T, H] where given."""
        return fused_moe(x, weights, ids, w.gate_up, w.down, activation=w.activation,
                         swiglu_limit=w.swiglu_limit, out=out)
