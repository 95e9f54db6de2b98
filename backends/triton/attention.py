"""Paged attention through the shared Triton kernels: the attention backend of CUDA and ROCm.

Like the native oracle, each step first stores its new K/V at ``batch.slot_mapping`` and then
reads every key back from the pages. Sequences that bring one new token go to the split-KV
decode kernel, the others to the prefill kernel. ``prepare`` sorts them once per step from the
host-side query lengths, so no layer syncs with the device; a pure decode batch (the shape CUDA
graphs capture) needs nothing but its size. A batch whose sequences all bring the same few tokens
(speculative decoding's verify steps, which verify graphs capture) goes to the decode kernel
whole, causal among each sequence's queries.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.core.families.attention import AttentionBackend, AttentionLayer, LayerKV, QKNorm
from engine.core.forward import ForwardBatch
from engine.core.native.rope import RotaryEmbedding

from .attention_decode import decode_attention
from .attention_prefill import prefill_attention
from .rope_kv import rope_store_kv


@dataclass(frozen=True)
class TritonAttentionMetadata:
    decode_seqs: torch.Tensor | None  # [Bd] int32, the sequences with exactly one new token; None: all of them
    prefill_seqs: torch.Tensor  # [Bp] int32, the others
    max_prefill_query_len: int
    query_len: int = 1  # with decode_seqs None: the new tokens of every sequence


def _indices(ids: list[int], num_seqs: int, device: torch.device) -> torch.Tensor:
    if len(ids) == num_seqs:
        return torch.arange(num_seqs, dtype=torch.int32, device=device)
    return torch.tensor(ids, dtype=torch.int32).to(device, non_blocking=True)


class TritonAttention(AttentionBackend):
    name = "triton"
    graph_safe = True
    graph_query_len = 16

    def prepare(self, batch: ForwardBatch) -> TritonAttentionMetadata:
        device = batch.seq_lens.device
        q_len = batch.uniform_query_len
        if q_len is not None and 1 < q_len <= self.graph_query_len:
            return TritonAttentionMetadata(None, _indices([], batch.num_seqs, device), 0, q_len)
        decode = [i for i, n in enumerate(batch.query_lens_cpu) if n == 1]
        prefill = [i for i, n in enumerate(batch.query_lens_cpu) if n != 1]
        return TritonAttentionMetadata(
            decode_seqs=None if len(decode) == batch.num_seqs else _indices(decode, batch.num_seqs, device),
            prefill_seqs=_indices(prefill, batch.num_seqs, device),
            max_prefill_query_len=max((batch.query_lens_cpu[i] for i in prefill), default=0),
        )

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerKV, layer: AttentionLayer,
                batch: ForwardBatch, out: torch.Tensor | None = None) -> torch.Tensor:
        """``out`` [T, num_heads, v_head_dim] in q's dtype, allocated when not given."""
        keys = kv.k.view(-1, *kv.k.shape[2:])  # [num_pages * page_size, Hkv, D]
        values = kv.v.view(-1, *kv.v.shape[2:])
        keys.index_copy_(0, batch.slot_mapping, k.to(keys.dtype))
        values.index_copy_(0, batch.slot_mapping, v.to(values.dtype))
        return self._attend(q, kv, layer, batch, out)

    def rope_forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: RotaryEmbedding,
                     positions: torch.Tensor, kv: LayerKV, layer: AttentionLayer, batch: ForwardBatch,
                     qk_norm: QKNorm | None = None) -> torch.Tensor:
        """One kernel normalises (``qk_norm``) and rotates q and k and stores k and v into the pages,
        then attention reads them."""
        q = rope_store_kv(q, k, v, positions, batch.slot_mapping, rope, kv, qk_norm=qk_norm)
        return self._attend(q, kv, layer, batch, None)

    def _attend(self, q: torch.Tensor, kv: LayerKV, layer: AttentionLayer, batch: ForwardBatch,
                out: torch.Tensor | None) -> torch.Tensor:
        meta = batch.attn_metadata if isinstance(batch.attn_metadata, TritonAttentionMetadata) else self.prepare(batch)
        if q.stride(-1) != 1:
            q = q.contiguous()
        if out is None:
            out = q.new_empty(q.shape[0], layer.num_heads, kv.v.shape[-1])
        decode_attention(q, kv, layer, out, batch.page_table, batch.query_start_loc, batch.seq_lens,
                         meta.decode_seqs, query_len=meta.query_len)
        prefill_attention(q, kv, layer, out, batch.page_table, batch.query_start_loc, batch.seq_lens,
                          meta.prefill_seqs, meta.max_prefill_query_len)
        return out
