"""MoE family: expert routing and expert compute."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from .linear import LinearBackend, LinearWeight


@dataclass(frozen=True)
class RoutingConfig:
    """How router logits become (weights, expert ids) per token.

    ``scoring``: "softmax", "sigmoid" or "sqrtsoftplus". ``num_groups``/``topk_groups``: grouped
    top-k (DeepSeek-V3): keep the best groups first, then the best experts inside them.
    ``correction_bias`` (no-aux routing) shifts the scores used to *choose* experts, not the
    weights. ``hash_table`` [vocab, top_k] routes by token id instead (DeepSeek-V4 hash layers).
    ``weight_dtype``: the weights come out rounded to it (held in fp32), for a model whose reference
    weighs the expert outputs in the activations' dtype (DeepSeek-V4), with no cast launched apart.
    ``shared_expert``: an expert every token also takes, with weight 1, appended after the top_k
    routed ones (so the route gives [T, top_k + 1]): DeepSeek-V4's shared expert, folded into the
    routed launch or sliced off for its own, with no column built apart.
    """

    num_experts: int
    top_k: int
    scoring: str = "softmax"
    renormalize: bool = True
    num_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    correction_bias: torch.Tensor | None = None
    hash_table: torch.Tensor | None = None
    weight_dtype: torch.dtype = torch.float32
    shared_expert: int | None = None

    def __post_init__(self) -> None:
        if self.shared_expert is not None and (type(self.shared_expert) is not int or self.shared_expert < 0):
            raise ValueError(f"shared_expert must be an expert index (an int >= 0), not {self.shared_expert!r}")


@dataclass
class ExpertWeights:
    """Stacked expert weights: ``gate_up`` [E, 2*I, H] (gate rows first), ``down`` [E, H, I], and how
    they are stored.

    ``scheme``: "dense" (bf16/fp16/fp32), "fp8_block" (E4M3 with fp32 scales per B x B block of
    each expert's matrix, [E, ceil(N/B), ceil(K/B)]: B = 128, or DeepSeek-V4.1's 32, which the
    scales' shape says) or "fp4" (E2M1 packed two per uint8 byte
    along K, element 2j in the low nibble, so ``gate_up`` is [E, 2*I, H/2] and ``down`` [E, H, I/2];
    uint8 E8M0 scales, one per 32 along K, [E, N, K/32]: DeepSeek-V4's routed experts).
    """

    gate_up: torch.Tensor
    down: torch.Tensor
    activation: str = "silu"
    swiglu_limit: float | None = None  # clamp of DeepSeek-V4's SwiGLU, None for plain SwiGLU
    scheme: str = "dense"
    gate_up_scale: torch.Tensor | None = None
    down_scale: torch.Tensor | None = None


@dataclass(frozen=True)
class Router:
    """A MoE layer's router: the linear layer [E, H] whose logits the routing reads, and the backend
    that applies it. ``route_experts`` takes it in place of the logits where a MoE backend may
    compute them in its routing's launch (a decode step's router GEMV, one launch fewer)."""

    weight: torch.Tensor
    linear: LinearBackend

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear.apply(x, LinearWeight(self.weight))


def router_logits_of(router: torch.Tensor | Router, x: torch.Tensor) -> torch.Tensor:
    """The [T, E] logits ``route_experts`` was given, or its router's of x."""
    return router.logits(x) if isinstance(router, Router) else router


class MoEBackend(ABC):
    name: str = "?"
    graph_safe: bool = True  # False if route or experts syncs with the host or sizes work from device values
    schemes: tuple[str, ...] = ("dense",)  # the ExpertWeights schemes ``experts`` runs
    fp8_blocks: tuple[int, ...] = (128,)  # the block edges of "fp8_block" experts it runs

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx

    @abstractmethod
    def route(
        self, router_logits: torch.Tensor, cfg: RoutingConfig, input_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, E] logits -> (weights [T, K] fp32, expert ids [T, K] int64); K is top_k, plus one
        with a shared expert."""

    @abstractmethod
    def experts(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w: ExpertWeights
    ) -> torch.Tensor:
        """[T, H] tokens through their top-k experts, combined by ``weights`` -> [T, H]. ``weights`` and
        ``ids`` [T, top_k] may be column slices of a wider routing (views: any row stride). A row whose
        ids are all -1 (an exchange's padding, core/distributed/moe.py) costs no expert work, and its
        output row is undefined."""

    def route_experts(self, x: torch.Tensor, router: torch.Tensor | Router, cfg: RoutingConfig, w: ExpertWeights,
                      input_ids: torch.Tensor | None = None, shared: ExpertWeights | None = None) -> torch.Tensor:
        """``experts`` of every column of ``route`` through the stack ``w`` (a shared expert folded in as
        its last), or, with ``shared``, the routed columns through ``w`` plus the shared one through
        ``shared`` (its own stack): the whole layer on one device from the router's logits or from
        the router itself, which a backend may fuse (the router, the routing and the alignment by
        expert in one launch). Expert-parallel placements route, dispatch and run ``experts`` apart
        instead."""
        weights, ids = self.route(router_logits_of(router, x), cfg, input_ids)
        if shared is None:
            return self.experts(x, weights, ids, w)
        k = cfg.top_k
        return self.experts(x, weights[:, :k], ids[:, :k], w) + self.experts(x, weights[:, k:], ids[:, k:], shared)
