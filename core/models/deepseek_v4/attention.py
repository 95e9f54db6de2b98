"""DeepSeek-V4 attention: low-rank q, one shared K=V head with partial RoPE, sinks, a sliding window
over raw tokens, and in compressed layers the pooled entries of a CSA or HCA compressor.

The projections are here, those of the attention input (the low-rank q, the KV, each compressor's,
the indexer's weights) as one GEMM per weight format, fed the input already normalised (the mHC
family runs the attention's input RMSNorm in its pre's last launch, at every batch size and weight
format, where a GEMM's prologue could take it only for one dense group of a few rows); everything
that reads or writes the cache (the window store, the compressors' pooling, the lightning
indexer's top-k, the attention itself, the rotations) is the V4 attention family's
(core/families/v4_attention.py), called for the whole step at once.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...distributed.layers import ColumnParallelLinear, RowParallelLinear, split
from ...families.v4_attention import Compression, IndexerLayer, V4AttentionLayer
from ...forward import ForwardBatch
from ...kv.storage import KVCache
from ...native.rope import RotaryEmbedding
from ..base import Backends
from ..fused_projection import FusedProjection
from ..layers import Linear, RMSNorm, empty_param
from .cache import LayerCache

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"


class GroupedLinear(nn.Module):
    """The grouped low-rank output projection's first half: each of G head groups has its own
    [rank, in] block of ``weight`` [G * rank, in]."""

    def __init__(self, in_per_group: int, rank: int, groups: int, *, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.weight = empty_param(groups * rank, in_per_group, dtype=dtype, device=device)
        self.groups = groups

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[T, G, in] -> [T, G * rank]."""
        w = self.weight.to(x.dtype).view(self.groups, -1, x.shape[-1]).transpose(1, 2)
        return torch.bmm(x.transpose(0, 1), w).transpose(0, 1).reshape(x.shape[0], -1)


class Compressor(nn.Module):
    """Projects tokens to (kv, gate); the family pools each window into one entry."""

    def __init__(self, hidden: int, head_dim: int, rate: int, overlap: bool, eps: float, backends: Backends, *,
                 dtype: torch.dtype, device) -> None:
        super().__init__()
        width = 2 * head_dim if overlap else head_dim
        self.wkv = Linear(hidden, width, backends.linear, dtype=dtype, device=device)
        self.wgate = Linear(hidden, width, backends.linear, dtype=dtype, device=device)
        self.ape = empty_param(rate, width, dtype=torch.float32, device=device)
        self.norm = RMSNorm(head_dim, eps, dtype=torch.float32, device=device)
        self.rate, self.overlap = rate, overlap

    def spec(self, projections: int, entries: int) -> Compression:
        return Compression(self.rate, self.overlap, self.ape, self.norm.weight, self.norm.eps, projections, entries)


class Indexer(nn.Module):
    """The lightning indexer of a CSA layer: its own overlapping compressor at index_head_dim, and
    queries from the attention's low-rank q."""

    def __init__(self, hf: dict, rate: int, backends: Backends, *, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.top_k = hf["index_n_heads"], hf["index_head_dim"], hf["index_topk"]
        self.wq_b = Linear(hf["q_lora_rank"], self.num_heads * self.head_dim, backends.linear, dtype=dtype,
                           device=device)
        self.weights_proj = Linear(hf["hidden_size"], self.num_heads, backends.linear, dtype=dtype, device=device)
        self.compressor = Compressor(hf["hidden_size"], self.head_dim, rate, True, hf.get("rms_norm_eps", 1e-6),
                                     backends, dtype=dtype, device=device)


class Attention(nn.Module):
    def __init__(self, hf: dict, layer_id: int, cache: LayerCache, backends: Backends,
                 ropes: dict[str, RotaryEmbedding], *, dtype: torch.dtype, device) -> None:
        super().__init__()
        hidden, eps, tp = hf["hidden_size"], hf.get("rms_norm_eps", 1e-6), backends.tp
        # under tensor parallelism the query heads and the output groups are split over the ranks;
        # the one KV head, the compressors and the indexer cannot be, and every rank holds them whole
        heads, self.head_dim, groups = hf["num_attention_heads"], hf["head_dim"], hf["o_groups"]
        self.num_heads = split(heads, tp.size, "num_attention_heads")
        self.groups, self.o_rank = split(groups, tp.size, "o_groups"), hf["o_lora_rank"]
        self.layer_type = hf["layer_types"][layer_id]
        self.rope = ropes["main" if self.layer_type == SLIDING else "compress"]
        self.cache = cache
        self.eps = eps
        self.backend, self.norm_backend = backends.v4_attention, backends.norm
        self.wq_a = Linear(hidden, hf["q_lora_rank"], backends.linear, dtype=dtype, device=device)
        self.q_norm = RMSNorm(hf["q_lora_rank"], eps, dtype=torch.float32, device=device, ops=backends.norm)
        self.wq_b = ColumnParallelLinear(hf["q_lora_rank"], heads * self.head_dim, backends.linear, tp, dtype=dtype,
                                         device=device)
        self.wkv = Linear(hidden, self.head_dim, backends.linear, dtype=dtype, device=device)
        self.norm = RMSNorm(self.head_dim, eps, dtype=torch.float32, device=device, ops=backends.norm)
        self.wo_a = GroupedLinear(heads * self.head_dim // groups, self.o_rank, self.groups, dtype=dtype, device=device)
        self.wo_b = RowParallelLinear(groups * self.o_rank, hidden, backends.linear, tp, dtype=dtype, device=device)
        self.attn_sink = empty_param(self.num_heads, dtype=torch.float32, device=device)
        for p in (self.wo_a.weight, self.attn_sink):  # the rank's groups' rows, its heads' sinks
            p.partition = (0, tp.rank, tp.size)
        self.window = hf["sliding_window"]
        self.compressor = self.indexer = None
        if self.layer_type != SLIDING:
            rate = hf["compress_rates"][self.layer_type]
            self.compressor = Compressor(hidden, self.head_dim, rate, self.layer_type == CSA, eps, backends,
                                         dtype=dtype, device=device)
            if self.layer_type == CSA:
                self.indexer = Indexer(hf, rate, backends, dtype=dtype, device=device)
        x_parts = ["wq_a", "wkv"]
        if self.compressor is not None:
            x_parts += ["compressor.wkv", "compressor.wgate"]
        if self.indexer is not None:
            x_parts += ["indexer.compressor.wkv", "indexer.compressor.wgate", "indexer.weights_proj"]
        self.x_proj = FusedProjection({name: self.get_submodule(name) for name in x_parts})
        self._spec: V4AttentionLayer | None = None

    def spec(self) -> V4AttentionLayer:
        """The family's view of this layer (made once, after the weights are in place)."""
        if self._spec is None:
            c = self.cache
            indexer = None
            if self.indexer is not None:
                indexer = IndexerLayer(self.indexer.num_heads, self.indexer.head_dim, self.indexer.top_k,
                                       self.indexer.compressor.spec(c.index_projections, c.index_keys))
            self._spec = V4AttentionLayer(
                self.num_heads, self.head_dim, self.window, self.attn_sink, self.rope, c.window,
                None if self.compressor is None else self.compressor.spec(c.projections, c.entries), indexer)
        return self._spec

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv: KVCache, meta: Any) -> torch.Tensor:
        """x [T, hidden], the batch's new tokens packed, through the attention's input norm (which the
        mHC pre before runs) -> [T, hidden]."""
        layer, backend = self.spec(), self.backend
        p = self.x_proj(x)
        q_low = self.q_norm(p["wq_a"])
        q = self.norm_backend.unweighted_rms_norm(self.wq_b(q_low).view(-1, self.num_heads, self.head_dim), self.eps)
        backend.store(self.norm(p["wkv"]), layer, kv, batch, meta)
        if self.compressor is not None:
            backend.compress(p["compressor.wkv"], p["compressor.wgate"], layer.compression, layer, kv, batch, meta)
        picks = None
        if self.indexer is not None:
            backend.compress(p["indexer.compressor.wkv"], p["indexer.compressor.wgate"], layer.indexer.compression,
                             layer, kv, batch, meta)
            q_index = self.indexer.wq_b(q_low).view(-1, self.indexer.num_heads, self.indexer.head_dim)
            weights = p["indexer.weights_proj"].float() * self.indexer.num_heads**-0.5
            picks = backend.select(q_index, weights, layer, kv, batch, meta)
        out = backend.attend(q, layer, kv, batch, meta, picks)
        return self.wo_b(self.wo_a(out.reshape(x.shape[0], self.groups, -1)))
