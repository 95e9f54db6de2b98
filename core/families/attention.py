"""Attention family: paged prefill and decode attention over a layer's KV pages."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from ..forward import ForwardBatch
from ..native.norm import rms_norm


@dataclass(frozen=True)
class AttentionLayer:
    """Per-layer attention parameters, fixed at model construction.

    ``sliding_window``: a query at position p sees keys at positions > p - sliding_window
    (HF semantics: the window counts the query itself). ``sinks``: one learned logit per query
    head that joins the softmax denominator and contributes no value (gpt-oss, DeepSeek-V4).
    """

    layer_id: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    v_head_dim: int | None = None
    sliding_window: int | None = None
    sinks: torch.Tensor | None = None  # [num_heads] fp32
    causal: bool = True


@dataclass
class LayerKV:
    """One layer's pages: ``k`` [num_pages, page_size, num_kv_heads, head_dim], ``v`` likewise."""

    k: torch.Tensor
    v: torch.Tensor


@dataclass(frozen=True)
class QKNorm:
    """Per-head RMSNorm of q and k before the rotation (Qwen3): weights [head_dim], one eps."""

    q_weight: torch.Tensor
    k_weight: torch.Tensor
    eps: float

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, D], k [T, Hk, D] normalised as core/native/norm.py does, the reference of a fused norm."""
        return rms_norm(q, self.q_weight, self.eps), rms_norm(k, self.k_weight, self.eps)


class AttentionBackend(ABC):
    """Stores the step's new K/V into pages and attends every new query over its sequence."""

    name: str = "?"
    # True if forward reads lengths only from the batch's device tensors (never its host lists) and
    # syncs with nothing, so a decode step can be captured in a graph and replayed with new contents
    graph_safe: bool = False
    # with graph_safe: the most new tokens per sequence a captured step may bring, each sequence the
    # same number, causal among them (speculative decoding's verify steps of K+1 tokens)
    graph_query_len: int = 1

    def __init__(self, ctx: Any) -> None:  # ctx: registry.SelectionContext; one constructor for all
        self.ctx = ctx

    def prepare(self, batch: ForwardBatch) -> Any:
        """Per-step metadata shared by all layers (computed once, kept in ``batch.attn_metadata``)."""
        return None

    def rope_forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: Any, positions: torch.Tensor,
                     kv: LayerKV, layer: AttentionLayer, batch: ForwardBatch,
                     qk_norm: QKNorm | None = None) -> torch.Tensor:
        """Normalise q and k by ``qk_norm`` if given, rotate them by ``rope`` (a
        core.native.rope.RotaryEmbedding) at ``positions``, then ``forward``; a backend may fuse the
        norm and the rotation with its store of K/V into the pages, rounding as the native ops do."""
        if qk_norm is not None:
            q, k = qk_norm.apply(q, k)
        q, k = rope.apply(q, k, positions)
        return self.forward(q, k, v, kv, layer, batch)

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, v_head_dim]
        kv: LayerKV,
        layer: AttentionLayer,
        batch: ForwardBatch,
    ) -> torch.Tensor:  # [T, num_heads, v_head_dim]
        ...
