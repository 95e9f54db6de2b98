"""DeepSeek-V4 attention in torch: the oracle of the V4 attention family, HF's arithmetic exactly.

One sequence at a time (its new tokens are a contiguous run of the batch), queries in chunks whose
fp32 scores stay under the native attention's ``CHUNK_ELEMENTS``: O(window + entries) per query,
whatever the context. Reads the batch's host lists, so it is not graph-safe.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..families.attention import AttentionLayer
from ..families.v4_attention import Compression, V4AttentionBackend, V4AttentionLayer
from ..forward import ForwardBatch
from ..kv.storage import KVCache
from ..models.deepseek_v4.cache import SeqView, entries_of, flat, sequences, window_slots
from .attention import CHUNK_ELEMENTS, attend
from .compressor import entry_positions, pool_windows, visible_entries
from .indexer import candidate_blocks, fp8_index_scores, in_blocks, index_scores, quantize_keys, top_entries
from .norm import rms_norm, unweighted_rms_norm
from .tail_rope import rotate_tail


@dataclass(frozen=True)
class NativeV4Metadata:
    seqs: list[SeqView]  # the sequences that bring tokens this step
    window_slots: torch.Tensor  # [T] each new token's slot in the window pages


def _rows_per_chunk(per_row: int) -> int:
    return max(1, CHUNK_ELEMENTS // max(1, per_row))


class NativeV4Attention(V4AttentionBackend):
    name = "native"
    window_floors = True

    def prepare(self, batch: ForwardBatch, kv: KVCache) -> NativeV4Metadata:
        windows = kv.window_table()
        return NativeV4Metadata(sequences(batch, windows), window_slots(batch.slot_mapping, windows, batch.page_size))

    def store(self, kv_new: torch.Tensor, layer: V4AttentionLayer, kv: KVCache, batch: ForwardBatch,
              meta: NativeV4Metadata) -> None:
        cos, sin = layer.rope.cos[batch.positions], layer.rope.sin[batch.positions]
        window_kv = flat(kv, layer.window_kv)[0]
        normed = rms_norm(kv_new, layer.kv_norm, layer.eps)
        window_kv.index_copy_(0, meta.window_slots, rotate_tail(normed, cos, sin).to(window_kv.dtype))

    def compress(self, kv_proj: torch.Tensor, gate_proj: torch.Tensor | None, comp: Compression,
                 layer: V4AttentionLayer, kv: KVCache, batch: ForwardBatch, meta: NativeV4Metadata) -> None:
        if comp.projections is None:  # rate 1: each token's projection is its entry
            for seq in meta.seqs:
                latent = rms_norm(kv_proj[seq.start:seq.start + seq.new], comp.norm_weight, comp.eps)
                self._keep(latent, seq.context, seq, comp, layer, kv)
            return
        projections = flat(kv, comp.projections)
        for dst, src in zip(projections, (kv_proj, gate_proj)):
            dst.index_copy_(0, meta.window_slots, src.to(dst.dtype))
        for seq in meta.seqs:
            self._close_windows(seq, projections, comp, layer, kv)

    @classmethod
    def _close_windows(cls, seq: SeqView, projections: tuple[torch.Tensor, torch.Tensor], comp: Compression,
                       layer: V4AttentionLayer, kv: KVCache) -> None:
        """Pool every window of ``seq`` whose last token the step brings and keep its entry.

        An overlapping window pools its predecessor's first half too, so that window's tokens are
        pooled along with it (window 0 has none) and its own entry, already kept, is dropped.
        """
        rate = comp.rate
        first, end = seq.context // rate, seq.end // rate
        if first == end:
            return
        lead = 1 if comp.overlap and first > 0 else 0
        slots = seq.token_slots((first - lead) * rate, end * rate)
        kv_p, gate = (p[slots] for p in projections)
        pooled = rms_norm(pool_windows(kv_p, gate, comp.ape, rate, comp.overlap)[lead:], comp.norm_weight, comp.eps)
        cls._keep(pooled, first, seq, comp, layer, kv)

    @staticmethod
    def _keep(latent: torch.Tensor, first: int, seq: SeqView, comp: Compression, layer: V4AttentionLayer,
              kv: KVCache) -> None:
        """Entries first.. of ``seq`` from their latents (normalised, not rotated): each rotated at its
        window's first position and kept in the latents' dtype (E4M3 with its scale where the
        entries layer keeps E4M3); and the index keys a CSA2 source derives from them."""
        end = first + latent.shape[0]
        pos = entry_positions(end, comp.rate, latent.device)[first:]
        cos, sin = layer.rope.cos[pos], layer.rope.sin[pos]
        slots = seq.entry_slots(first, end, comp.rate)
        _store(rotate_tail(latent, cos, sin), slots, entries_of(kv, comp.entries))
        if comp.index_key is not None:
            key = comp.index_key
            k = rms_norm(key.project(latent), key.norm_weight, key.eps)
            _store(rotate_tail(k, cos, sin), slots, entries_of(kv, key.keys))

    def select(self, q: torch.Tensor, weights: torch.Tensor, layer: V4AttentionLayer, kv: KVCache,
               batch: ForwardBatch, meta: NativeV4Metadata, candidates: torch.Tensor | None = None) -> torch.Tensor:
        indexer = layer.indexer
        picks = torch.full((q.shape[0], indexer.top_k), -1, dtype=torch.int32, device=q.device)
        for r, scores, visible in self._scores(q, weights, layer, kv, batch, meta):
            allowed = None
            if candidates is not None:
                allowed = in_blocks(candidates[r], scores.shape[-1], indexer.candidate_block_size)
            chosen = top_entries(scores, visible, indexer.top_k, allowed)
            picks[r, :chosen.shape[1]] = chosen
        return picks

    def select_candidates(self, q: torch.Tensor, weights: torch.Tensor, layer: V4AttentionLayer, kv: KVCache,
                          batch: ForwardBatch, meta: NativeV4Metadata) -> torch.Tensor:
        indexer = layer.indexer
        blocks = torch.full((q.shape[0], indexer.candidate_blocks), -1, dtype=torch.int32, device=q.device)
        for r, scores, visible in self._scores(q, weights, layer, kv, batch, meta):
            blocks[r] = candidate_blocks(scores, visible, indexer.candidate_blocks, indexer.candidate_block_size)
        return blocks

    @staticmethod
    def _scores(q: torch.Tensor, weights: torch.Tensor, layer: V4AttentionLayer, kv: KVCache, batch: ForwardBatch,
                meta: NativeV4Metadata):
        """(rows, their scores [rows, entries] over every entry of their sequence, how many each
        sees) for the step's queries, a chunk of one sequence at a time."""
        indexer = layer.indexer
        rate = indexer.compression.rate
        cos, sin = layer.rope.cos[batch.positions][:, None], layer.rope.sin[batch.positions][:, None]
        q = rotate_tail(q, cos, sin)
        keys_kv, scales_kv = entries_of(kv, indexer.compression.entries)
        weights = weights.float() * indexer.num_heads ** -0.5
        for seq in meta.seqs:
            slots = seq.entry_slots(0, seq.end // rate, rate)
            keys = keys_kv[slots]
            scales = None if scales_kv is None else scales_kv[slots]
            positions = batch.positions[seq.start:seq.start + seq.new]
            step = _rows_per_chunk(indexer.num_heads * keys.shape[0])
            for a in range(0, seq.new, step):
                r = slice(seq.start + a, seq.start + min(a + step, seq.new))
                scores = (index_scores(q[r], keys, weights[r]) if scales is None
                          else fp8_index_scores(q[r], keys, scales, weights[r]))
                yield r, scores, visible_entries(positions[a:a + step], rate)

    def attend(self, q: torch.Tensor, layer: V4AttentionLayer, kv: KVCache, batch: ForwardBatch,
               meta: NativeV4Metadata, picks: torch.Tensor | None = None) -> torch.Tensor:
        cos, sin = layer.rope.cos[batch.positions][:, None], layer.rope.sin[batch.positions][:, None]
        q = rotate_tail(unweighted_rms_norm(q, layer.eps), cos, sin)
        out = torch.empty(*q.shape, dtype=torch.float32, device=q.device)
        for seq in meta.seqs:
            rows = slice(seq.start, seq.start + seq.new)
            self._attend(seq, q[rows], batch.positions[rows], None if picks is None else picks[rows], layer, kv,
                         out[rows])
        return rotate_tail(out.to(q.dtype), cos, -sin)

    @staticmethod
    def _attend(seq: SeqView, q: torch.Tensor, positions: torch.Tensor, picks: torch.Tensor | None,
                layer: V4AttentionLayer, kv: KVCache, out: torch.Tensor) -> None:
        """One sequence's new queries into ``out``, in chunks of at most ``window`` queries, each over
        the tokens its window reaches and the entries closed before its last query."""
        comp, window = layer.compression, layer.window
        entries = None
        if comp is not None:
            entries = flat(kv, comp.entries)[0][seq.entry_slots(0, seq.end // comp.rate, comp.rate)]
        window_kv = flat(kv, layer.window_kv)[0]
        spec = AttentionLayer(layer_id=0, num_heads=layer.num_heads, num_kv_heads=1, head_dim=layer.head_dim,
                              scale=layer.scale, sinks=layer.sinks)
        num_entries = 0 if entries is None else entries.shape[0]
        step = max(1, min(window, _rows_per_chunk(layer.num_heads * (2 * window + num_entries))))
        for a in range(0, seq.new, step):
            b = min(a + step, seq.new)
            first, end = max(seq.floor, seq.context + a - window + 1), seq.context + b
            keys = window_kv[seq.token_slots(first, end)]
            k_pos = torch.arange(first, end, device=positions.device)[None, :]
            q_pos = positions[a:b, None]
            allowed = (k_pos <= q_pos) & (k_pos > q_pos - window)
            if entries is not None:
                n = end // comp.rate
                if picks is not None:
                    chosen = picks[a:b].long()
                    seen = torch.zeros(b - a, n + 1, dtype=torch.bool, device=q.device)
                    seen.scatter_(1, torch.where(chosen < 0, n, chosen), True)
                    seen = seen[:, :n]
                else:
                    seen = torch.arange(n, device=q.device) < visible_entries(positions[a:b], comp.rate)[:, None]
                keys, allowed = torch.cat([keys, entries[:n]]), torch.cat([allowed, seen], dim=-1)
            k_s = keys.float()[None]
            q_c = q[a:b].float().view(b - a, 1, layer.num_heads, -1).permute(1, 2, 0, 3)
            out[a:b] = attend(q_c, k_s, k_s, allowed[None, None], spec)[0].permute(1, 0, 2)  # [1, H, b - a, D]


def _store(values: torch.Tensor, slots: torch.Tensor, layer: tuple[torch.Tensor, torch.Tensor | None]) -> None:
    """Keep ``values`` [N, d] at ``slots`` of a per-entry layer: rounded to its dtype, or as E4M3 with
    one fp32 scale each (amax / 448) where it keeps E4M3."""
    keys, scales = layer
    if scales is not None:
        data, scale = quantize_keys(values)
        keys.view(torch.uint8).index_copy_(0, slots, data.view(torch.uint8))  # no E4M3 index_copy_ on the CPU
        scales.index_copy_(0, slots, scale)
    else:
        keys.index_copy_(0, slots, values.to(keys.dtype))
