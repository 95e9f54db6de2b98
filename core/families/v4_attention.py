"""V4 attention family: DeepSeek-V4's attention over a whole step at once.

A V4 layer attends over two kinds of keys: the last ``window`` tokens (the sliding window, one
shared K=V head) and, in compressed layers, pooled entries, one per ``rate`` tokens (HCA: every
visible entry; CSA: the ``top_k`` the lightning indexer picks). Where each component lives in the
KV pages is core/models/deepseek_v4/cache.py's layout; a backend reads and writes them there.

Per layer the model calls, in order: ``store`` (the window KV) and ``compress`` for each compressor
(its projections, and the entries of windows that close in this step), in a compressed layer as
one ``store_and_compress``, then ``select`` (CSA only), then ``attend``. The KV and the query come
raw from their projections: ``store`` and ``attend`` run their RMSNorms, so neither costs a launch
of its own. ``prepare`` runs once per step, inside
the step (so inside a captured graph), and its result is passed to every call.

Masking, as the oracle (core/native/v4_attention.py) does it: a query at position p sees window
keys at positions p - window + 1 .. p and entries 0 .. (p + 1) // rate - 1 (an entry is visible
from the token after its window closes). Ties in the indexer go to the lowest entry index.

DeepSeek-V4.1's CSA2 layers (core/models/deepseek_v4/topology.py) use the same calls: a layer
reading another's entries has that layer's ``compression`` and is never asked to ``compress``;
a KV source's compression pools pairs (rate 2, no position bias) or keeps each token (rate 1)
and derives the index keys from its entries (``index_key``); a candidate source calls
``select_candidates`` before ``select``, and the index sources after it pass those blocks to
``select``. A backend without these refuses such a model at selection, naming why.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from ..forward import ForwardBatch
from ..kv.storage import KVCache
from .linear import MXFP8Tensor


@dataclass(frozen=True)
class IndexKey:
    """CSA2's index keys, derived from its entries: key = RMSNorm(project(latent)) rotated as the
    entry is, where latent is the entry normalised and not yet rotated."""

    project: Any  # a linear layer: latent [N, head_dim] -> [N, index_head_dim]
    norm_weight: torch.Tensor  # [index_head_dim] fp32
    eps: float
    keys: int  # cache layer: per entry, k = the key; if k is E4M3, v = its fp32 scale [1]


@dataclass(frozen=True)
class Compression:
    """One compressor: softmax-gated pooling of each window of ``rate`` tokens into one entry.

    With ``overlap`` (CSA) each token projects twice the width, and entry w pools window w-1's first
    half of the channels with window w's second half. Entries are RMS-normalised by
    ``norm_weight`` and rotated at their window's first position. At rate 1 (CSA2) there is no
    gate: each token's projection is its entry.
    """

    rate: int
    overlap: bool
    ape: torch.Tensor | None  # [rate, width] fp32: the gate's bias by slot within the window (CSA2: none)
    norm_weight: torch.Tensor  # [head_dim] fp32
    eps: float
    projections: int | None  # cache layer: per token, k = the kv projection, v = the gate projection [width]; rate 1: none
    entries: int  # cache layer: per entry, k = the pooled entry [head_dim]; if k is E4M3, v = its fp32 scale [1]
    index_key: IndexKey | None = None  # CSA2 KV source that indexes: the keys it derives from its entries

    @property
    def head_dim(self) -> int:
        return int(self.norm_weight.shape[0])


@dataclass(frozen=True)
class IndexerLayer:
    """The lightning indexer of a CSA layer: its own compressor makes the keys it scores. In CSA2,
    ``compression.entries`` is the layer of the keys its KV source derives (``IndexKey.keys``)."""

    num_heads: int
    head_dim: int
    top_k: int
    compression: Compression
    candidate_blocks: int = 0  # > 0: a candidate source, publishing this many blocks per query
    candidate_block_size: int = 0  # entries per candidate block
    filtered: bool = False  # takes its top-k inside the candidate source's blocks


@dataclass(frozen=True)
class V4AttentionLayer:
    """Per-layer parameters, fixed at model construction."""

    num_heads: int
    head_dim: int
    window: int  # a query sees window keys at positions > p - window
    sinks: torch.Tensor  # [num_heads] fp32: a logit per head in the softmax denominator, no value
    rope: Any  # core.native.rope.RotaryEmbedding: cos/sin [max_pos, rope_dim // 2], interleaved pairs
    window_kv: int  # cache layer: per token, k = the normalised, rotated KV the window reads
    kv_norm: torch.Tensor  # [head_dim] fp32: the weight of the KV's RMSNorm, which ``store`` runs
    eps: float  # of the KV's RMSNorm and of the per-head query RMSNorm ``attend`` runs
    compression: Compression | None = None  # CSA or HCA entries
    indexer: IndexerLayer | None = None  # CSA

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5


def emits_mxfp8(ctx: Any, backend: V4AttentionBackend) -> bool:
    """Whether ``backend``'s ``attend`` returns MXFP8: as ``EngineConfig.mxfp8_attention`` says (True
    fails, naming why, where the backend or the model cannot), else (None) wherever it can and the
    platform multiplies MXFP8 natively (block-scaled MMA: sm_100, gfx950)."""
    asked = getattr(getattr(ctx, "engine_config", None), "mxfp8_attention", None)
    model = getattr(ctx, "model_config", None)
    head_dim = model.hf.get("head_dim", 0) if model is not None else 0
    reasons = [] if backend.can_emit_mxfp8 else [f"the {backend.name} V4 attention backend does not emit it"]
    if head_dim % 32:
        reasons.append(f"head_dim {head_dim} is not a multiple of MXFP8's blocks of 32")
    if asked and reasons:
        raise ValueError(f"mxfp8_attention: {'; '.join(reasons)}")
    if asked is not None:
        return bool(asked)
    return not reasons and "mxfp8" in getattr(getattr(ctx, "platform", None), "capabilities", ())


class V4AttentionBackend(ABC):
    name: str = "?"
    # True if every method reads the batch's shape from device tensors only and syncs with nothing
    graph_safe: bool = False
    # with graph_safe: the most new tokens per sequence a captured step may bring, each sequence the
    # same number (speculative decoding's verify steps of K+1 tokens; AttentionBackend's likewise)
    graph_query_len: int = 1
    # True if ``attend`` can quantize its output to MXFP8 in its epilogue (``emits_mxfp8`` says whether it does)
    can_emit_mxfp8: bool = False
    # True if ``attend`` hides window keys before each sequence's ``ForwardBatch.window_floors_cpu``
    # (what DeepSeek-V4.1's SWA bounded replay needs: the window KV below the floor was never written)
    window_floors: bool = False

    def __init__(self, ctx: Any) -> None:  # ctx: registry.SelectionContext
        self.ctx = ctx
        self.emits_mxfp8 = emits_mxfp8(ctx, self)

    def prepare(self, batch: ForwardBatch, kv: KVCache) -> Any:
        """Per-step metadata shared by every layer's calls (run inside the step)."""
        return None

    @abstractmethod
    def store(self, kv_new: torch.Tensor, layer: V4AttentionLayer, kv: KVCache, batch: ForwardBatch,
              meta: Any) -> None:
        """RMS-normalise the step's window KV [T, head_dim] by ``layer.kv_norm`` (in fp32, rounded once
        to ``kv_new``'s dtype), rotate it at its tokens' positions, rounded to that dtype again, and
        store it in ``layer.window_kv`` at their window slots."""

    @abstractmethod
    def compress(self, kv_proj: torch.Tensor, gate_proj: torch.Tensor, comp: Compression, layer: V4AttentionLayer,
                 kv: KVCache, batch: ForwardBatch, meta: Any) -> None:
        """Store the step's projections [T, width] at their tokens' window slots, then pool every
        window whose last token the step brings into its entry (gate + ape softmax over the window's
        slots per channel in fp32; RMSNorm; rotation by ``layer.rope`` at the window's first
        position), stored in ``comp.entries``: rounded to the projections' dtype, then, where that
        layer keeps E4M3, quantized with one fp32 scale per entry (amax / 448; 1 for a zero entry)."""

    def store_and_compress(self, kv_new: torch.Tensor, kv_proj: torch.Tensor, gate_proj: torch.Tensor,
                           comp: Compression, layer: V4AttentionLayer, kv: KVCache, batch: ForwardBatch,
                           meta: Any, indexer: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """``store`` of the window KV, then ``compress`` of the layer's own compressor and, given a CSA
        layer's ``indexer`` (kv, gate) projections, of its indexer's into ``layer.indexer.compression``:
        what a compressed layer writes before it reads, which a backend may write in one pass."""
        self.store(kv_new, layer, kv, batch, meta)
        self.compress(kv_proj, gate_proj, comp, layer, kv, batch, meta)
        if indexer is not None:
            self.compress(*indexer, layer.indexer.compression, layer, kv, batch, meta)

    def store_compress_and_select(self, kv_new: torch.Tensor, kv_proj: torch.Tensor, gate_proj: torch.Tensor,
                                  comp: Compression, layer: V4AttentionLayer, kv: KVCache, batch: ForwardBatch,
                                  meta: Any, indexer: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor,
                                  weights: torch.Tensor) -> torch.Tensor:
        """A CSA layer's ``store_and_compress`` (with its ``indexer``'s projections), then ``select`` of
        ``q`` and ``weights`` over the index keys it wrote: what a CSA layer writes and then picks,
        which a backend may run in one pass."""
        self.store_and_compress(kv_new, kv_proj, gate_proj, comp, layer, kv, batch, meta, indexer=indexer)
        return self.select(q, weights, layer, kv, batch, meta)

    @abstractmethod
    def select(self, q: torch.Tensor, weights: torch.Tensor, layer: V4AttentionLayer, kv: KVCache,
               batch: ForwardBatch, meta: Any, candidates: torch.Tensor | None = None) -> torch.Tensor:
        """The indexer's choice: q [T, Hi, di] (unrotated), weights [T, Hi] as the indexer's weights
        projection gives them (any float dtype), which count as ``weights.float() * Hi^-0.5`` (the
        backend scales them, so the model launches nothing for it) -> int32 [T, top_k]: the entries
        of the ``top_k`` highest scores among those visible, score(s) = sum_h weights_h *
        relu(rope(q_h) . key_s) * di^-0.5, ties to the lowest index; -1 fills the rest of a row.
        The order within a row is unspecified. E4M3 keys count as key * scale. ``candidates`` (from ``select_candidates``): only entries in those blocks."""

    def select_candidates(self, q: torch.Tensor, weights: torch.Tensor, layer: V4AttentionLayer, kv: KVCache,
                          batch: ForwardBatch, meta: Any) -> torch.Tensor:
        """A candidate source's blocks: int32 [T, candidate_blocks], the blocks (of
        ``candidate_block_size`` entries) with the highest best score among each query's visible
        entries, the block of its newest visible entry always first choice, ties to the lowest
        block; -1 where fewer blocks hold a visible entry. The order within a row is unspecified."""
        raise NotImplementedError(f"the {self.name} V4 attention backend has no candidate filter")

    @abstractmethod
    def attend(self, q: torch.Tensor, layer: V4AttentionLayer, kv: KVCache, batch: ForwardBatch, meta: Any,
               picks: torch.Tensor | None = None) -> torch.Tensor | MXFP8Tensor:
        """q [T, H, D] (raw: not normalised, unrotated) -> [T, H, D] in q's dtype: RMS-normalise each
        head without a weight (the statistic in fp32, its reciprocal root rounded to q's dtype before
        the product, as HF's DeepseekV4UnweightedRMSNorm), rotate q, attend over its window keys and
        its entries (``picks`` from ``select`` in CSA, every visible one in HCA) with K = V and the
        sinks, round to q's dtype and rotate the output back. Where ``emits_mxfp8``, that output
        quantized to MXFP8 (core/native/quant.py's ``quantize_mxfp8``) for the output projection."""
