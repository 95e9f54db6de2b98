"""Paged attention in plain torch: the definition every attention kernel is checked against.

Each step first stores its new K/V at ``batch.slot_mapping``, then reads every key back from the
pages, so the pages are the only source of keys and values. Scores, softmax and the weighted sum
are fp32. Prefill and mixed batches go one sequence at a time; batches whose sequences all
bring the same few new tokens (decodes, speculative decoding's verify steps) go together, padded
to the longest sequence with a mask, each query masked by its position (so causal among a
sequence's new tokens). Work is split into chunks whose fp32 working tensors
stay under ``CHUNK_ELEMENTS``: long prompts never hold all T x L scores, and chunks small enough
to stay in cache run faster than one big pass.

The batched path reads no host list but the batch's shape, so a decode graph captures it on a
placeholder batch whose lengths are each sequence's bound (its keys up to ``max_model_len``, masked).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..families.attention import AttentionBackend, AttentionLayer, LayerKV
from ..forward import ForwardBatch

CHUNK_ELEMENTS = 1 << 21
UNIFORM_QUERY_LEN = 16  # up to this many new tokens each, a batch of equal query lengths goes together


@dataclass(frozen=True)
class NativeAttentionMetadata:
    """Each layer's view of the step's keys: ``key_slots`` [B, max_seq_len] is the slot of each
    sequence's key at each position (past its length it points into padding and is masked). Made
    by every layer from the batch's device tensors, not once a step by ``prepare``: a captured
    graph's ``prepare`` runs once, outside the capture, and its replays read new page tables."""

    key_slots: torch.Tensor
    key_valid: torch.Tensor  # [B, max_seq_len] bool, position < seq_len


def _chunk(per_item: int) -> int:
    """How many items (queries or sequences) of ``per_item`` fp32 elements make one chunk."""
    return max(1, CHUNK_ELEMENTS // max(1, per_item))


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """[..., L, Hkv, D] (any dtype) -> contiguous fp32 [..., Hkv, L, D], the layout the matmuls want."""
    t = x.transpose(-3, -2)
    return torch.empty(t.shape, dtype=torch.float32, device=x.device).copy_(t)


def _allowed(q_pos: torch.Tensor, k_pos: torch.Tensor, layer: AttentionLayer) -> torch.Tensor:
    """[..., Tq, L] which keys each query may see: causal and the sliding window, by absolute position."""
    q_pos, k_pos = q_pos[..., :, None], k_pos[..., None, :]
    allowed = k_pos <= q_pos if layer.causal else torch.ones_like(k_pos <= q_pos)
    if layer.sliding_window is not None:
        allowed = allowed & (k_pos > q_pos - layer.sliding_window)
    return allowed


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
            layer: AttentionLayer) -> torch.Tensor:
    """q [..., Hkv, G, Tq, D], k [..., Hkv, L, D], v [..., Hkv, L, Dv], allowed broadcastable to
    [..., Hkv, G, Tq, L] -> [..., Hkv, G, Tq, Dv]. Each KV head serves its group of G query heads.

    Softmax as exp(score - logsumexp): a sink is one more logit per head that joins the
    log-sum-exp and carries no value.
    """
    *lead, group, tq, d = q.shape
    scores = (q.reshape(*lead, group * tq, d) @ k.transpose(-1, -2)).view(*lead, group, tq, -1)
    scores.mul_(layer.scale).masked_fill_(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    if layer.sinks is not None:
        lse = torch.logaddexp(lse, layer.sinks.float().view(layer.num_kv_heads, -1, 1, 1))
    # in place where nothing differentiates it; a drafter in training (core/spec/train_mtp.py) keeps the scores
    probs = ((scores - lse).exp() if scores.requires_grad else scores.sub_(lse).exp_()).view(*lead, group * tq, -1)
    return (probs @ v).view(*lead, group, tq, -1)


class NativeAttention(AttentionBackend):
    name = "native"
    graph_safe = True
    graph_query_len = UNIFORM_QUERY_LEN

    @staticmethod
    def keys(batch: ForwardBatch) -> NativeAttentionMetadata:
        positions = torch.arange(batch.max_seq_len, device=batch.page_table.device)
        pages = batch.page_table[:, positions // batch.page_size].long()
        return NativeAttentionMetadata(
            key_slots=pages * batch.page_size + positions % batch.page_size,
            key_valid=positions < batch.seq_lens[:, None],
        )

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerKV, layer: AttentionLayer,
                batch: ForwardBatch) -> torch.Tensor:
        keys = kv.k.view(-1, *kv.k.shape[2:])  # [num_pages * page_size, Hkv, D]
        values = kv.v.view(-1, *kv.v.shape[2:])
        keys.index_copy_(0, batch.slot_mapping, k.to(keys.dtype))
        values.index_copy_(0, batch.slot_mapping, v.to(values.dtype))
        meta = self.keys(batch)
        q_len = batch.uniform_query_len
        if q_len is not None and q_len <= UNIFORM_QUERY_LEN:
            out = self._uniform(q, keys, values, layer, batch, meta, q_len)
        else:
            out = self._prefill(q, keys, values, layer, batch, meta)
        return out.to(q.dtype)

    def _prefill(self, q, keys, values, layer: AttentionLayer, batch: ForwardBatch,
                 meta: NativeAttentionMetadata) -> torch.Tensor:
        """One sequence at a time, its queries in chunks; keys 0..seq_len-1 are all written."""
        out = q.new_empty(q.shape[0], layer.num_heads, values.shape[-1], dtype=torch.float32)
        start = 0
        for i, (q_len, ctx, seq_len) in enumerate(zip(batch.query_lens_cpu, batch.context_lens_cpu,
                                                      batch.seq_lens_cpu)):
            slots = meta.key_slots[i, :seq_len]
            k_i, v_i = _heads_first(keys[slots]), _heads_first(values[slots])  # [Hkv, L, D]
            k_pos = torch.arange(seq_len, device=q.device)
            step = _chunk(layer.num_heads * seq_len)
            for first in range(0, q_len, step):
                last = min(first + step, q_len)  # queries first..last-1 sit at positions ctx+first..
                lo, hi = self._key_range(ctx + first, ctx + last - 1, seq_len, layer)
                s, e = start + first, start + last
                q_c = q[s:e].float().view(e - s, layer.num_kv_heads, -1, q.shape[-1]).permute(1, 2, 0, 3)
                allowed = _allowed(batch.positions[s:e], k_pos[lo:hi], layer)
                o = attend(q_c, k_i[:, lo:hi], v_i[:, lo:hi], allowed, layer)
                out[s:e] = o.permute(2, 0, 1, 3).reshape(e - s, layer.num_heads, -1)
            start += q_len
        return out

    @staticmethod
    def _key_range(first_pos: int, last_pos: int, seq_len: int, layer: AttentionLayer) -> tuple[int, int]:
        """Keys [lo, hi) any query at positions first_pos..last_pos may see: the rest is masked for
        all of them, so it is skipped (half of a causal prefill's work)."""
        hi = last_pos + 1 if layer.causal else seq_len
        lo = max(0, first_pos - layer.sliding_window + 1) if layer.sliding_window is not None else 0
        return lo, hi

    def _uniform(self, q, keys, values, layer: AttentionLayer, batch: ForwardBatch,
                 meta: NativeAttentionMetadata, q_len: int) -> torch.Tensor:
        """All sequences at once (in chunks of sequences), ``q_len`` queries each, padded keys masked."""
        num_seqs, max_len = meta.key_slots.shape
        out = q.new_empty(num_seqs * q_len, layer.num_heads, values.shape[-1], dtype=torch.float32)
        k_pos = torch.arange(max_len, device=q.device)
        positions = batch.positions.view(num_seqs, q_len)
        step = _chunk(max_len * (q_len * layer.num_heads + layer.num_kv_heads * (keys.shape[-1] + values.shape[-1])))
        for s in range(0, num_seqs, step):
            e = min(s + step, num_seqs)
            slots, valid = meta.key_slots[s:e], meta.key_valid[s:e]
            # padded slots may hold anything, even NaN: zero their values so 0 * NaN cannot leak in
            v_c = _heads_first(values[slots].masked_fill_(~valid[:, :, None, None], 0))  # [b, Hkv, L, Dv]
            k_c = _heads_first(keys[slots])
            q_c = q[s * q_len:e * q_len].float().view(e - s, q_len, layer.num_kv_heads, -1, q.shape[-1])
            q_c = q_c.permute(0, 2, 3, 1, 4)  # [b, Hkv, G, q_len, D]
            allowed = _allowed(positions[s:e], k_pos, layer) & valid[:, None, :]  # [b, q_len, L]
            o = attend(q_c, k_c, v_c, allowed[:, None, None], layer)  # [b, Hkv, G, q_len, Dv]
            out[s * q_len:e * q_len] = o.permute(0, 3, 1, 2, 4).reshape((e - s) * q_len, layer.num_heads, -1)
        return out
