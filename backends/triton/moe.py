"""MoE on Triton: routing in one kernel (moe_routing.py), the experts through the fused grouped GEMMs;
in a decode step routing and alignment in one (moe_dispatch.py; at batch 1 with the router's GEMV,
moe_router.py) and each stack's experts in one more (moe_one_launch.py).

Grouped top-k (DeepSeek-V3) keeps the native routing, torch ops without a host synchronisation.
Neither path reads a device value on the host, so routing and experts can be captured in a graph.
"""

from __future__ import annotations

import torch

from engine.core.families.linear import FP8_BLOCKS
from engine.core.families.moe import ExpertWeights, MoEBackend, Router, RoutingConfig, router_logits_of
from engine.core.native.moe import NativeMoE

from . import moe_routing
from .fp8_quant import GROUP
from .fused_moe import PACKED_FP4, fp8_expert_block, fused_moe
from .moe_dispatch import fits_one_program, route_and_align
from .moe_one_launch import arrival_counts, fits_one_launch, moe_one_launch
from .moe_router import project_route_and_align, projects_in_dispatch
from .moe_tiles import moe_config


class TritonMoE(MoEBackend):
    name = "triton"
    schemes = ("dense", "fp8_block", "fp4")
    fp8_blocks = FP8_BLOCKS  # 32-blocks in K steps of 32 (fused_moe.py)
    one_launch = True  # a decode step's stack in one launch (moe_one_launch) where it fits; else two

    def route(self, router_logits: torch.Tensor, cfg: RoutingConfig,
              input_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if cfg.num_groups > 1:
            return NativeMoE.route(self, router_logits, cfg, input_ids)
        return moe_routing.route(router_logits, cfg, input_ids)

    def route_experts(self, x: torch.Tensor, router: torch.Tensor | Router, cfg: RoutingConfig, w: ExpertWeights,
                      input_ids: torch.Tensor | None = None, shared: ExpertWeights | None = None) -> torch.Tensor:
        """A decode step's routing and alignment in one launch (``moe_dispatch``; at batch 1 given the
        ``Router``, with its GEMV, ``moe_router``), the shared expert's own stack aligned by it too,
        then each stack's experts in one launch (``moe_one_launch``; or its two grouped GEMMs where
        that does not fit), the shared stack's adding to the routed one's output: two launches a
        layer with the shared expert folded, three with it apart; larger batches and grouped routing
        route and align apart, and take two GEMM launches a stack."""
        for stack in (w, shared or w):
            self._check_scheme(stack)
        num_tokens, k = x.shape[0], cfg.top_k
        gemm = self._gemm_config(num_tokens, k if shared else moe_routing.route_width(cfg), w)
        shared_gemm = self._gemm_config(num_tokens, 1, shared) if shared else None
        if fits_one_program(num_tokens, cfg, x.device):
            dispatch = dict(num_experts=w.gate_up.shape[0], block_m=gemm.block_m,
                            shared_block_m=shared_gemm and shared_gemm.block_m,
                            arrival_counts=self._arrival_counts(x, w, gemm, k if shared else
                                                                moe_routing.route_width(cfg)),
                            shared_arrival_counts=shared and self._arrival_counts(x, shared, shared_gemm, 1))
            if isinstance(router, Router) and projects_in_dispatch(x, router.weight):
                weights, ids, blocks, shared_blocks = project_route_and_align(x, router.weight, cfg, input_ids,
                                                                              **dispatch)
            else:
                weights, ids, blocks, shared_blocks = route_and_align(router_logits_of(router, x), cfg, input_ids,
                                                                      **dispatch)
        else:
            weights, ids = self.route(router_logits_of(router, x), cfg, input_ids)
            blocks = shared_blocks = None
        if shared is None:
            return self._fused(x, weights, ids, w, gemm, blocks)
        out = self._fused(x, weights[:, :k], ids[:, :k], w, gemm, blocks)
        return self._fused(x, weights[:, k:], ids[:, k:], shared, shared_gemm, shared_blocks, out=out)

    @staticmethod
    def _gemm_config(num_tokens: int, columns: int, w: ExpertWeights):
        return moe_config(num_tokens, columns, w.gate_up.shape[0], w.gate_up.device, fp4=w.gate_up.dtype == PACKED_FP4,
                          fp8_block=fp8_expert_block(w.gate_up, w.gate_up_scale) or GROUP)

    def _arrival_counts(self, x: torch.Tensor, w: ExpertWeights, gemm, columns: int) -> int | None:
        """The counters a stack's one launch needs, None where it takes two."""
        if not self.one_launch or not fits_one_launch(w.gate_up, gemm, x.shape[0], columns,
                                                      gate_up_scale=w.gate_up_scale):
            return None
        return arrival_counts(x.shape[0], x.shape[1], gemm)

    @staticmethod
    def _fused(x, weights, ids, w: ExpertWeights, gemm, blocks, out: torch.Tensor | None = None) -> torch.Tensor:
        """fused_moe of ``w``, in one launch where the blocks carry its counters; with ``out``, added to it."""
        if blocks is not None and blocks.counters is not None:
            return moe_one_launch(x, blocks, w.gate_up, w.down, weights, ids, gemm,
                                  torch.empty_like(x) if out is None else out, swiglu_limit=w.swiglu_limit,
                                  gate_up_scale=w.gate_up_scale, down_scale=w.down_scale, accumulate=out is not None)
        return fused_moe(x, weights, ids, w.gate_up, w.down, activation=w.activation, swiglu_limit=w.swiglu_limit,
                         gate_up_scale=w.gate_up_scale, down_scale=w.down_scale, config=gemm, blocks=blocks, out=out,
                         accumulate=out is not None)

    def _check_scheme(self, w: ExpertWeights) -> None:
        if w.scheme not in self.schemes:
            raise ValueError(f"expert scheme {w.scheme!r} is not supported; supported: {self.schemes}")

    def experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w: ExpertWeights,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """As ``NativeMoE.experts``, written into ``out`` [T, H] where given; the scheme travels in the
        weights' dtypes (E4M3 for fp8_block, packed uint8 for fp4)."""
        self._check_scheme(w)
        return fused_moe(x, weights, ids, w.gate_up, w.down, activation=w.activation, swiglu_limit=w.swiglu_limit,
                         gate_up_scale=w.gate_up_scale, down_scale=w.down_scale, out=out)
