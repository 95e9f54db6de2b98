"""DeepSeek-V4 attention: low-rank q, one shared K=V head with partial RoPE, sinks, a sliding window
over raw tokens, and in compressed layers the pooled entries of a CSA or HCA compressor.

Computed here in torch over whole sequences (positions 0..S-1), one sequence at a time, its
queries in chunks whose fp32 scores stay under the native attention's ``CHUNK_ELEMENTS``.
"""

from __future__ import annotations

import torch
from torch import nn

from ...families.attention import AttentionLayer
from ...native.attention import CHUNK_ELEMENTS, attend
from ...native.compressor import entry_positions, pool_windows, visible_entries
from ...native.indexer import index_scores, select_entries
from ...native.mhc import unweighted_rms_norm
from ...native.rope import RotaryEmbedding
from ...native.tail_rope import rotate_tail
from ..base import Backends
from ..layers import Linear, RMSNorm, empty_param

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

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding) -> torch.Tensor:
        """x [S, hidden] of one sequence from position 0 -> entries [S // rate, head_dim]."""
        entries = self.norm(pool_windows(self.wkv(x), self.wgate(x), self.ape, self.rate, self.overlap))
        pos = entry_positions(entries.shape[0], self.rate, entries.device)
        return rotate_tail(entries, rope.cos[pos], rope.sin[pos])


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

    def forward(self, x: torch.Tensor, q_low: torch.Tensor, positions: torch.Tensor,
                rope: RotaryEmbedding) -> torch.Tensor:
        """bool [S, S // rate]: the entries each query of the sequence attends to."""
        keys = self.compressor(x, rope)
        q = self.wq_b(q_low).view(-1, self.num_heads, self.head_dim)
        q = rotate_tail(q, rope.cos[positions][:, None], rope.sin[positions][:, None])
        weights = self.weights_proj(x).float() * self.num_heads**-0.5
        visible = visible_entries(positions, self.rate)
        step = _rows_per_chunk(self.num_heads * keys.shape[0])
        return torch.cat([select_entries(index_scores(q[a:a + step], keys, weights[a:a + step]),
                                         visible[a:a + step], self.top_k) for a in range(0, q.shape[0], step)])


class Attention(nn.Module):
    def __init__(self, hf: dict, layer_id: int, backends: Backends, ropes: dict[str, RotaryEmbedding], *,
                 dtype: torch.dtype, device) -> None:
        super().__init__()
        hidden, eps = hf["hidden_size"], hf.get("rms_norm_eps", 1e-6)
        self.num_heads, self.head_dim = hf["num_attention_heads"], hf["head_dim"]
        self.groups, self.o_rank = hf["o_groups"], hf["o_lora_rank"]
        self.layer_type = hf["layer_types"][layer_id]
        self.rope = ropes["main" if self.layer_type == SLIDING else "compress"]
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

    def forward(self, x: torch.Tensor, positions: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        """x [T, hidden] of whole sequences packed back to back -> [T, hidden]."""
        cos, sin = self.rope.cos[positions], self.rope.sin[positions]
        q_low = self.q_norm(self.wq_a(x))
        q = unweighted_rms_norm(self.wq_b(q_low).view(-1, self.num_heads, self.head_dim), self.eps)
        q = rotate_tail(q, cos[:, None], sin[:, None])
        kv = rotate_tail(self.norm(self.wkv(x)), cos, sin)
        spec = self.layer_spec()
        out = torch.empty(x.shape[0], self.num_heads, self.head_dim, dtype=torch.float32, device=x.device)
        start = 0
        for n in seq_lens:
            s = slice(start, start + n)
            keys, allowed = self._keys(x[s], q_low[s], kv[s], positions[s])
            k_s = keys.float()[None]
            step = _rows_per_chunk(self.num_heads * keys.shape[0])
            for a in range(0, n, step):
                b = min(a + step, n)
                q_c = q[start + a:start + b].float().view(b - a, 1, self.num_heads, -1).permute(1, 2, 0, 3)
                o = attend(q_c, k_s, k_s, allowed[None, None, a:b], spec)  # [1, H, b - a, D]
                out[start + a:start + b] = o[0].permute(1, 0, 2)
            start += n
        out = rotate_tail(out.to(x.dtype), cos[:, None], -sin[:, None])
        return self.wo_b(self.wo_a(out.reshape(x.shape[0], self.groups, -1)))

    def _keys(self, x: torch.Tensor, q_low: torch.Tensor, kv: torch.Tensor,
              positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence's keys (its tokens, then its compressed entries) and which each query sees."""
        q_pos, k_pos = positions[:, None], positions[None, :]
        allowed = (k_pos <= q_pos) & (k_pos > q_pos - self.window)
        if self.compressor is None:
            return kv, allowed
        entries = self.compressor(x, self.rope)
        if self.indexer is not None:
            seen = self.indexer(x, q_low, positions, self.rope)
        else:
            seen = torch.arange(entries.shape[0], device=x.device) < visible_entries(positions, self.rate)[:, None]
        return torch.cat([kv, entries.to(kv.dtype)]), torch.cat([allowed, seen], dim=-1)
