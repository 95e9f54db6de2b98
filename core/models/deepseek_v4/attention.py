"""DeepSeek-V4 attention: low-rank q, one shared K=V head with partial RoPE, sinks, a sliding window
over raw tokens, and in compressed layers the pooled entries of a CSA or HCA compressor.

Each step stores its new tokens' components in the cache (cache.py), pools the compression
windows that close in it, and attends each sequence's new queries over the last ``window`` tokens
and the entries: O(window + entries) per query, whatever the context. In torch, one sequence at a
time, queries in chunks whose fp32 scores stay under the native attention's ``CHUNK_ELEMENTS``.
"""

from __future__ import annotations

import torch
from torch import nn

from ...families.attention import AttentionLayer
from ...forward import ForwardBatch
from ...kv.storage import KVCache
from ...native.attention import CHUNK_ELEMENTS, attend
from ...native.compressor import entry_positions, pool_windows, visible_entries
from ...native.indexer import index_scores, select_entries
from ...native.mhc import unweighted_rms_norm
from ...native.rope import RotaryEmbedding
from ...native.tail_rope import rotate_tail
from ..base import Backends
from ..layers import Linear, RMSNorm, empty_param
from .cache import LayerCache, SeqView, flat, window_slots

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"


def _rows_per_chunk(per_row: int) -> int:
    return max(1, CHUNK_ELEMENTS // max(1, per_row))


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
    """Projects tokens to (kv, gate), pools each window into one entry, normalises and rotates it."""

    def __init__(self, hidden: int, head_dim: int, rate: int, overlap: bool, eps: float, backends: Backends, *,
                 dtype: torch.dtype, device) -> None:
        super().__init__()
        width = 2 * head_dim if overlap else head_dim
        self.wkv = Linear(hidden, width, backends.linear, dtype=dtype, device=device)
        self.wgate = Linear(hidden, width, backends.linear, dtype=dtype, device=device)
        self.ape = empty_param(rate, width, dtype=torch.float32, device=device)
        self.norm = RMSNorm(head_dim, eps, dtype=torch.float32, device=device)
        self.rate, self.overlap = rate, overlap

    def store(self, x: torch.Tensor, slots: torch.Tensor, projections: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Keep the kv and gate projections of the step's tokens x [T, hidden] at their token slots."""
        for dst, w in zip(projections, (self.wkv, self.wgate)):
            dst.index_copy_(0, slots, w(x).to(dst.dtype))

    def close_windows(self, seq: SeqView, projections: tuple[torch.Tensor, torch.Tensor], entries: torch.Tensor,
                      rope: RotaryEmbedding) -> None:
        """Pool every window whose last token the step brings and keep its entry.

        An overlapping window pools its predecessor's Ca half too, so that window's tokens are
        pooled along with it (window 0 has none) and its own entry, already kept, is dropped.
        """
        first, end = seq.context // self.rate, seq.end // self.rate
        if first == end:
            return
        lead = 1 if self.overlap and first > 0 else 0
        slots = seq.token_slots((first - lead) * self.rate, end * self.rate)
        kv, gate = (p[slots] for p in projections)
        pooled = self.norm(pool_windows(kv, gate, self.ape, self.rate, self.overlap)[lead:])
        pos = entry_positions(end, self.rate, pooled.device)[first:]
        entries.index_copy_(0, seq.entry_slots(first, end, self.rate),
                            rotate_tail(pooled, rope.cos[pos], rope.sin[pos]).to(entries.dtype))


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
        self.rate = rate

    def select(self, x: torch.Tensor, q_low: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor,
               rope: RotaryEmbedding) -> torch.Tensor:
        """Queries of one sequence, its indexer keys [N, d] -> bool [S, N]: the entries each attends to."""
        q = self.wq_b(q_low).view(-1, self.num_heads, self.head_dim)
        q = rotate_tail(q, rope.cos[positions][:, None], rope.sin[positions][:, None])
        weights = self.weights_proj(x).float() * self.num_heads**-0.5
        visible = visible_entries(positions, self.rate)
        step = _rows_per_chunk(self.num_heads * keys.shape[0])
        return torch.cat([select_entries(index_scores(q[a:a + step], keys, weights[a:a + step]),
                                         visible[a:a + step], self.top_k) for a in range(0, q.shape[0], step)])


class Attention(nn.Module):
    def __init__(self, hf: dict, layer_id: int, cache: LayerCache, backends: Backends,
                 ropes: dict[str, RotaryEmbedding], *, dtype: torch.dtype, device) -> None:
        super().__init__()
        hidden, eps = hf["hidden_size"], hf.get("rms_norm_eps", 1e-6)
        self.num_heads, self.head_dim = hf["num_attention_heads"], hf["head_dim"]
        self.groups, self.o_rank = hf["o_groups"], hf["o_lora_rank"]
        self.layer_type = hf["layer_types"][layer_id]
        self.rope = ropes["main" if self.layer_type == SLIDING else "compress"]
        self.cache = cache
        self.eps = eps
        self.wq_a = Linear(hidden, hf["q_lora_rank"], backends.linear, dtype=dtype, device=device)
        self.q_norm = RMSNorm(hf["q_lora_rank"], eps, dtype=torch.float32, device=device)
        self.wq_b = Linear(hf["q_lora_rank"], self.num_heads * self.head_dim, backends.linear, dtype=dtype,
                           device=device)
        self.wkv = Linear(hidden, self.head_dim, backends.linear, dtype=dtype, device=device)
        self.norm = RMSNorm(self.head_dim, eps, dtype=torch.float32, device=device)
        self.wo_a = GroupedLinear(self.num_heads * self.head_dim // self.groups, self.o_rank, self.groups,
                                  dtype=dtype, device=device)
        self.wo_b = Linear(self.groups * self.o_rank, hidden, backends.linear, dtype=dtype, device=device)
        self.attn_sink = empty_param(self.num_heads, dtype=torch.float32, device=device)
        self.window = hf["sliding_window"]
        self.compressor = self.indexer = None
        if self.layer_type != SLIDING:
            self.rate = hf["compress_rates"][self.layer_type]
            self.compressor = Compressor(hidden, self.head_dim, self.rate, self.layer_type == CSA, eps, backends,
                                         dtype=dtype, device=device)
            if self.layer_type == CSA:
                self.indexer = Indexer(hf, self.rate, backends, dtype=dtype, device=device)

    def layer_spec(self) -> AttentionLayer:
        return AttentionLayer(layer_id=0, num_heads=self.num_heads, num_kv_heads=1, head_dim=self.head_dim,
                              scale=self.head_dim**-0.5, sinks=self.attn_sink)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv: KVCache, seqs: list[SeqView]) -> torch.Tensor:
        """x [T, hidden], the batch's new tokens packed -> [T, hidden]."""
        cos, sin = self.rope.cos[batch.positions], self.rope.sin[batch.positions]
        q_low = self.q_norm(self.wq_a(x))
        q = unweighted_rms_norm(self.wq_b(q_low).view(-1, self.num_heads, self.head_dim), self.eps)
        q = rotate_tail(q, cos[:, None], sin[:, None])
        slots = window_slots(batch.slot_mapping, kv.window_table(), batch.page_size)
        window_kv = flat(kv, self.cache.window)[0]
        window_kv.index_copy_(0, slots, rotate_tail(self.norm(self.wkv(x)), cos, sin).to(window_kv.dtype))
        if self.compressor is not None:
            self.compressor.store(x, slots, flat(kv, self.cache.projections))
        if self.indexer is not None:
            self.indexer.compressor.store(x, slots, flat(kv, self.cache.index_projections))
        spec = self.layer_spec()
        out = torch.empty(x.shape[0], self.num_heads, self.head_dim, dtype=torch.float32, device=x.device)
        for seq in seqs:
            rows = slice(seq.start, seq.start + seq.new)
            self._attend(seq, q[rows], x[rows], q_low[rows], batch.positions[rows], kv, out[rows], spec)
        out = rotate_tail(out.to(x.dtype), cos[:, None], -sin[:, None])
        return self.wo_b(self.wo_a(out.reshape(x.shape[0], self.groups, -1)))

    def _attend(self, seq: SeqView, q: torch.Tensor, x: torch.Tensor, q_low: torch.Tensor, positions: torch.Tensor,
                kv: KVCache, out: torch.Tensor, spec: AttentionLayer) -> None:
        """One sequence's new queries into ``out``, in chunks of at most ``window`` queries, each over
        the tokens its window reaches and the entries closed before its last query."""
        entries = index_keys = None
        if self.compressor is not None:
            slots = seq.entry_slots(0, seq.end // self.rate, self.rate)
            entries_kv = flat(kv, self.cache.entries)[0]
            self.compressor.close_windows(seq, flat(kv, self.cache.projections), entries_kv, self.rope)
            entries = entries_kv[slots]
            if self.indexer is not None:
                keys_kv = flat(kv, self.cache.index_keys)[0]
                self.indexer.compressor.close_windows(seq, flat(kv, self.cache.index_projections), keys_kv, self.rope)
                index_keys = keys_kv[slots]
        window_kv = flat(kv, self.cache.window)[0]
        num_entries = 0 if entries is None else entries.shape[0]
        step = max(1, min(self.window, _rows_per_chunk(self.num_heads * (2 * self.window + num_entries))))
        for a in range(0, seq.new, step):
            b = min(a + step, seq.new)
            first, end = max(0, seq.context + a - self.window + 1), seq.context + b
            keys = window_kv[seq.token_slots(first, end)]
            k_pos = torch.arange(first, end, device=positions.device)[None, :]
            q_pos = positions[a:b, None]
            allowed = (k_pos <= q_pos) & (k_pos > q_pos - self.window)
            if entries is not None:
                n = end // self.rate
                if self.indexer is not None:
                    seen = self.indexer.select(x[a:b], q_low[a:b], positions[a:b], index_keys[:n], self.rope)
                else:
                    seen = torch.arange(n, device=x.device) < visible_entries(positions[a:b], self.rate)[:, None]
                keys, allowed = torch.cat([keys, entries[:n]]), torch.cat([allowed, seen], dim=-1)
            k_s = keys.float()[None]
            q_c = q[a:b].float().view(b - a, 1, self.num_heads, -1).permute(1, 2, 0, 3)
            out[a:b] = attend(q_c, k_s, k_s, allowed[None, None], spec)[0].permute(1, 0, 2)  # [1, H, b - a, D]
