"""DeepSeek-V4 attention: low-rank q, one shared K=V head with partial RoPE, sinks, a sliding window
over raw tokens, and in compressed layers the pooled entries of a CSA or HCA compressor.

The projections are here, those of the attention input (the low-rank q, the KV, each compressor's,
the indexer's weights) as one GEMM per weight format, fed the input already normalised (the mHC
family runs the attention's input RMSNorm in its pre's last launch, at every batch size and weight
format, where a GEMM's prologue could take it only for one dense group of a few rows); everything
that reads or writes the cache (the window store and the KV's RMSNorm, the compressors' pooling,
the lightning indexer's top-k, the attention itself and the query's per-head RMSNorm, the
rotations) is the V4 attention family's (core/families/v4_attention.py), called for the whole
step at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ...distributed.layers import ColumnParallelLinear, RowParallelLinear, split
from ...families.linear import MX_BLOCK, LinearBackend, LinearWeight, MXFP8Tensor
from ...families.v4_attention import Compression, IndexerLayer, IndexKey, V4AttentionLayer
from ...forward import ForwardBatch
from ...kv.storage import KVCache
from ...native.quant import FP8, quantize_fp8_block_e8m0
from ...native.rope import RotaryEmbedding
from ..base import Backends
from ..fused_projection import FusedProjection
from ..layers import Linear, RMSNorm, empty_param, quantized_params
from .cache import LayerCache
from .topology import CSA2Role

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
CSA2 = "compressed_sparse_attention_2"  # V4.1: entries at ratio 1 or 2, shared across layers (topology.py)


class GroupedLinear(nn.Module):
    """The grouped low-rank output projection's first half: each of G head groups has its own
    [rank, in] block of ``weight`` [G * rank, in]. Held dense, or as DeepSeek-V4.1 stores it
    (``keep_fp8_block``: E4M3 with a scale per 32 x 32 block); fed MXFP8 (an attention that emits
    it), it multiplies in MXFP8 or on the stored blocks through the linear backend, a dense weight
    once ``keep_mxfp8`` has quantized it."""

    def __init__(self, in_per_group: int, rank: int, groups: int, backend: LinearBackend, *, dtype: torch.dtype,
                 device) -> None:
        super().__init__()
        self.weight = empty_param(groups * rank, in_per_group, dtype=dtype, device=device)
        self.register_parameter("weight_scale", None)
        self.groups, self.backend, self.scheme = groups, backend, "dense"

    def splits_blocks(self, block: int) -> bool:
        """Whether a tensor-parallel rank's rows (its groups') would cut a ``block``-row block of scales."""
        partition = getattr(self.weight, "partition", None)
        return partition is not None and partition[2] > 1 and self.weight.shape[0] % block != 0

    def keep_fp8_block(self, scale_shape: tuple[int, ...]) -> None:
        """Hold the weight as stored, E4M3 with fp32 block scales of ``scale_shape``, empty until loaded."""
        self.weight, self.weight_scale = quantized_params(self.weight, FP8, scale_shape, torch.float32)
        self.scheme = "fp8_block"

    def keep_mxfp8(self) -> None:
        """Quantize the loaded weight to MXFP8: E4M3 with one E8M0 scale per 32 along K, each amax / 448
        rounded up to a power of two, so nothing saturates and DeepSeek's FP8 checkpoints (E8M0
        scales on 128 x 128 blocks, which their 1 x 32 blocks refine) keep every value exactly."""
        if self.scheme != "dense":
            raise ValueError(f"the output projection holds its weight as {self.scheme}, not dense (keep_mxfp8)")
        partition = getattr(self.weight, "partition", None)
        data, scale = quantize_fp8_block_e8m0(self.weight.detach(), block=1, cols=MX_BLOCK)
        self.weight = nn.Parameter(data, requires_grad=False)
        self.weight_scale = nn.Parameter(scale, requires_grad=False)
        self.weight_scale.values_per_element = 0  # a scale stands for no weight of its own (weights.resident_bytes)
        if partition is not None:
            self.weight.partition = self.weight_scale.partition = partition
        self.scheme = "mxfp8"

    def forward(self, x: torch.Tensor | MXFP8Tensor, then: RowParallelLinear) -> torch.Tensor:
        """[T, G, in] -> [T, hidden]: this half, then ``then`` (wo_b) over its [T, G * rank], through
        the linear backend as one product (which may be one launch), the ranks' sum after."""
        if isinstance(x, MXFP8Tensor) and self.scheme == "dense":
            raise ValueError("the output projection was fed MXFP8 but holds its weight unquantized (keep_mxfp8)")
        weight = LinearWeight(self.weight, self.scheme, self.weight_scale)
        return then.reduce(self.backend.low_rank_output(x, weight, then.local_weight))


class Compressor(nn.Module):
    """Projects tokens to (kv, gate); the family pools each window into one entry. CSA2's has no
    position bias, and at rate 1 no gate (each token's projection is its entry)."""

    def __init__(self, hidden: int, head_dim: int, rate: int, overlap: bool, eps: float, backends: Backends, *,
                 dtype: torch.dtype, device, csa2: bool = False) -> None:
        super().__init__()
        width = 2 * head_dim if overlap else head_dim
        self.wkv = Linear(hidden, width, backends.linear, dtype=dtype, device=device)
        self.wgate = self.ape = None
        if rate > 1 or not csa2:
            self.wgate = Linear(hidden, width, backends.linear, dtype=dtype, device=device)
        if not csa2:
            self.ape = empty_param(rate, width, dtype=torch.float32, device=device)
        self.norm = RMSNorm(head_dim, eps, dtype=torch.float32, device=device)
        self.rate, self.overlap = rate, overlap

    def spec(self, projections: int | None, entries: int, index_key: IndexKey | None = None) -> Compression:
        return Compression(self.rate, self.overlap, self.ape, self.norm.weight, self.norm.eps, projections, entries,
                           index_key)


class Indexer(nn.Module):
    """The lightning indexer: queries from the attention's low-rank q and per-head weights from its
    input. V4's CSA has its own overlapping compressor at index_head_dim for the keys; a CSA2 KV
    source derives them from its entries (``wk``, ``k_norm``); a later CSA2 index source scores
    its KV source's."""

    def __init__(self, hf: dict, rate: int, backends: Backends, *, dtype: torch.dtype, device,
                 keys: str = "compressor") -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.top_k = hf["index_n_heads"], hf["index_head_dim"], hf["index_topk"]
        eps = hf.get("rms_norm_eps", 1e-6)
        self.wq_b = Linear(hf["q_lora_rank"], self.num_heads * self.head_dim, backends.linear, dtype=dtype,
                           device=device)
        self.weights_proj = Linear(hf["hidden_size"], self.num_heads, backends.linear, dtype=dtype, device=device)
        self.compressor = self.wk = self.k_norm = None
        if keys == "compressor":
            self.compressor = Compressor(hf["hidden_size"], self.head_dim, rate, True, eps, backends, dtype=dtype,
                                         device=device)
        elif keys == "derived":
            self.wk = Linear(hf["head_dim"], self.head_dim, backends.linear, dtype=dtype, device=device)
            self.k_norm = RMSNorm(self.head_dim, eps, dtype=torch.float32, device=device)


@dataclass
class StepShare:
    """What layers hand down the stack within one step (they run in order, so every source writes
    before its readers): each CSA2 index source's picks, the candidate source's blocks, and the
    tokens' n-gram ids that every Engram layer hashes."""

    picks: dict[int, torch.Tensor] = field(default_factory=dict)
    candidates: torch.Tensor | None = None
    ngram_ids: torch.Tensor | None = None


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
        self.layer_id, self.layer_type = layer_id, hf["layer_types"][layer_id]
        self.role: CSA2Role | None = hf["csa2_roles"][layer_id]
        self.rope = ropes["main" if self.layer_type == SLIDING else "compress"]
        self.cache = cache
        self.eps = eps
        self.backend = backends.v4_attention
        self.wq_a = Linear(hidden, hf["q_lora_rank"], backends.linear, dtype=dtype, device=device)
        self.q_norm = RMSNorm(hf["q_lora_rank"], eps, dtype=torch.float32, device=device, ops=backends.norm)
        self.wq_b = ColumnParallelLinear(hf["q_lora_rank"], heads * self.head_dim, backends.linear, tp, dtype=dtype,
                                         device=device)
        self.wkv = Linear(hidden, self.head_dim, backends.linear, dtype=dtype, device=device)
        self.norm = RMSNorm(self.head_dim, eps, dtype=torch.float32, device=device)  # the family's store runs it
        self.wo_a = GroupedLinear(heads * self.head_dim // groups, self.o_rank, self.groups, backends.linear,
                                  dtype=dtype, device=device)
        self.wo_b = RowParallelLinear(groups * self.o_rank, hidden, backends.linear, tp, dtype=dtype, device=device)
        self.attn_sink = empty_param(self.num_heads, dtype=torch.float32, device=device)
        for p in (self.wo_a.weight, self.attn_sink):  # the rank's groups' rows, its heads' sinks
            p.partition = (0, tp.rank, tp.size)
        self.window = hf["sliding_window"]
        self.compressor = self.indexer = None
        self.source: tuple[Attention, ...] = ()  # CSA2: the KV source's attention (set by the decoder), not a submodule
        role = self.role
        if role is not None:
            if role.owns_compressor(layer_id):
                self.compressor = Compressor(hidden, self.head_dim, role.ratio, False, eps, backends, dtype=dtype,
                                             device=device, csa2=True)
            if role.indexes(layer_id):
                self.indexer = Indexer(hf, role.ratio, backends, dtype=dtype, device=device,
                                       keys="derived" if role.keeps_index_keys else "shared")
        elif self.layer_type != SLIDING:
            rate = hf["compress_rates"][self.layer_type]
            self.compressor = Compressor(hidden, self.head_dim, rate, self.layer_type == CSA, eps, backends,
                                         dtype=dtype, device=device)
            if self.layer_type == CSA:
                self.indexer = Indexer(hf, rate, backends, dtype=dtype, device=device)
        x_parts = ["wq_a", "wkv"]
        if self.compressor is not None:
            x_parts += ["compressor.wkv"] + (["compressor.wgate"] if self.compressor.wgate is not None else [])
        if self.indexer is not None and self.indexer.compressor is not None:
            x_parts += ["indexer.compressor.wkv", "indexer.compressor.wgate"]
        if self.indexer is not None:
            x_parts += ["indexer.weights_proj"]
        self.x_proj = FusedProjection({name: self.get_submodule(name) for name in x_parts})
        # the query and the indexer's query project one normed low-rank q: one GEMM with the norm in it
        q_parts = ["wq_b"] + (["indexer.wq_b"] if self.indexer is not None else [])
        self.q_proj = FusedProjection({name: self.get_submodule(name) for name in q_parts})
        self._spec: V4AttentionLayer | None = None

    def weights_loaded(self) -> None:
        """Once the weights are in: fuse the input projections and the query projections, and where
        the attention emits MXFP8 quantize the output projection's weight for it."""
        self.x_proj.fuse()
        self.q_proj.fuse()
        if self.backend.emits_mxfp8 and self.wo_a.scheme == "dense":
            self.wo_a.keep_mxfp8()

    def _index_keys(self) -> Compression:
        """A CSA2 KV source's index keys, as the indexers that score them see them."""
        norm = self.indexer.k_norm
        return Compression(self.role.ratio, False, None, norm.weight, norm.eps, None, self.cache.index_keys)

    def _compression(self) -> Compression | None:
        """The entries this layer attends over (a CSA2 layer's: its KV source's)."""
        c = self.cache
        if self.role is None:
            return None if self.compressor is None else self.compressor.spec(c.projections, c.entries)
        if self.compressor is None:
            return self.source[0].spec().compression
        key = None
        if self.role.keeps_index_keys:
            key = IndexKey(self.indexer.wk, self.indexer.k_norm.weight, self.indexer.k_norm.eps, c.index_keys)
        return self.compressor.spec(c.projections, c.entries, key)

    def spec(self) -> V4AttentionLayer:
        """The family's view of this layer (made once, after the weights are in place)."""
        if self._spec is None:
            c, idx, role = self.cache, self.indexer, self.role
            indexer = None
            if idx is not None and role is None:
                indexer = IndexerLayer(idx.num_heads, idx.head_dim, idx.top_k,
                                       idx.compressor.spec(c.index_projections, c.index_keys))
            elif idx is not None:
                keys = (self if role.keeps_index_keys else self.source[0])._index_keys()
                indexer = IndexerLayer(idx.num_heads, idx.head_dim, idx.top_k, keys, role.candidate_blocks,
                                       role.candidate_block_size, role.filtered)
            self._spec = V4AttentionLayer(self.num_heads, self.head_dim, self.window, self.attn_sink, self.rope,
                                          c.window, self.norm.weight, self.eps, self._compression(), indexer)
        return self._spec

    def write_shared(self, x: torch.Tensor, batch: ForwardBatch, kv: KVCache, meta: Any) -> None:
        """A KV source's shared entries (and index keys) of tokens that no query of its own reads: its
        compressor over ``x``, without the window KV or the attention (SWA bounded replay, replay.py)."""
        layer, p = self.spec(), self.x_proj(x)
        self.backend.compress(p["compressor.wkv"], p.get("compressor.wgate"), layer.compression, layer, kv, batch,
                              meta)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv: KVCache, meta: Any, share: StepShare) -> torch.Tensor:
        """x [T, hidden], the batch's new tokens packed, through the attention's input norm (which the
        mHC pre before runs) -> [T, hidden]."""
        layer, backend = self.spec(), self.backend
        p, qs = self.x_proj.then_normed(x, "wq_a", self.q_norm, self.q_proj)
        q = qs["wq_b"].view(-1, self.num_heads, self.head_dim)  # attend normalises each head
        picks = q_index = weights = None
        if self.indexer is not None:
            q_index = qs["indexer.wq_b"].view(-1, self.indexer.num_heads, self.indexer.head_dim)
            weights = p["indexer.weights_proj"]  # the backend scales it by num_heads^-0.5 in fp32
        if self.indexer is not None and self.indexer.compressor is not None:  # CSA: the indexer picks what it wrote
            index = (p["indexer.compressor.wkv"], p["indexer.compressor.wgate"])
            picks = backend.store_compress_and_select(p["wkv"], p["compressor.wkv"], p.get("compressor.wgate"),
                                                      layer.compression, layer, kv, batch, meta, index, q_index,
                                                      weights)
        elif self.compressor is not None:
            backend.store_and_compress(p["wkv"], p["compressor.wkv"], p.get("compressor.wgate"), layer.compression,
                                       layer, kv, batch, meta)
        else:
            backend.store(p["wkv"], layer, kv, batch, meta)
        if self.indexer is not None:
            if picks is None:
                if layer.indexer.candidate_blocks:
                    share.candidates = backend.select_candidates(q_index, weights, layer, kv, batch, meta)
                picks = backend.select(q_index, weights, layer, kv, batch, meta,
                                       share.candidates if layer.indexer.filtered else None)
            share.picks[self.layer_id] = picks
        elif self.role is not None and self.role.index_source is not None:
            picks = share.picks[self.role.index_source]  # "Reuse": the picks of the layer's index source
        out = backend.attend(q, layer, kv, batch, meta, picks)
        return self.wo_a(out.reshape(x.shape[0], self.groups, -1), self.wo_b)
