"""DeepSeek-V4 attention on Triton kernels: the V4 attention family of CUDA and ROCm.

The whole step at once, with no per-sequence Python loop and no host sync: ``prepare`` turns the
batch into per-token device tensors (each token's sequence and window slot, in one launch), and
every piece reads the rest (positions, page table, window table) from the device. One module per piece:
the window store (with the KV's RMSNorm) is v4_window.py, ``attend (with the query's) is
v4_sparse_attention.py, ``compress`` v4_compressor.py and ``select`` (the lightning indexer)
v4_indexer.py; a CSA layer's decode step compresses and selects in one launch, v4_compress_select.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.core.families.linear import MXFP8Tensor
from engine.core.families.v4_attention import Compression, V4AttentionBackend, V4AttentionLayer
from engine.core.forward import ForwardBatch
from engine.core.kv.storage import KVCache
from engine.core.models.deepseek_v4.cache import flat

from . import v4_compress_select as compress_select
from .pdl import launch_options, wait_for_prior
from .v4_compressor import compress
from .v4_indexer import select, select_candidates
from .v4_sparse_attention import sparse_attention
from .v4_window import store_window


@dataclass(frozen=True)
class TritonV4Metadata:
    token_seq: torch.Tensor  # [T] int32: the batch row (sequence) of each new token
    window_slots: torch.Tensor  # [T] int64: each new token's slot in the window pages
    window_table: torch.Tensor  # [num_pages] int32: page -> window page (kv.window_table())
    max_entries: int  # static bound on entries per sequence: ceil(page-table reach / min rate), for grids/scratch


def _min_rate(ctx) -> int:
    """The smallest compression rate of the model's layers (1 for a backend built without a model):
    by layer type, or where config.json gives ``compress_ratios`` per layer (V4.1's CSA2), by those."""
    hf = ctx.model_config.hf if getattr(ctx, "model_config", None) is not None else {}
    rates = [r for t, r in (hf.get("compress_rates") or {}).items() if t in (hf.get("layer_types") or [])]
    rates += [r for r in (hf.get("compress_ratios") or [])[:hf.get("num_hidden_layers")] if r]
    return min(rates, default=1)


class TritonV4Attention(V4AttentionBackend):
    name = "triton"
    graph_safe = True
    graph_query_len = 16  # each piece takes a step of any shape, every token's sequence and position on the device
    can_emit_mxfp8 = True

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self._min_rate = _min_rate(ctx)

    def prepare(self, batch: ForwardBatch, kv: KVCache) -> TritonV4Metadata:
        windows = kv.window_table()
        # the page table's width covers every sequence (max_model_len in a captured graph's static table)
        max_entries = -(-batch.page_table.shape[1] * batch.page_size // self._min_rate)
        return TritonV4Metadata(*token_metadata(batch.query_start_loc, batch.slot_mapping, windows, batch.page_size),
                                windows, max_entries)

    def store(self, kv_new: torch.Tensor, layer: V4AttentionLayer, kv: KVCache, batch: ForwardBatch,
              meta: TritonV4Metadata) -> None:
        store_window(kv_new, layer.kv_norm, layer.eps, flat(kv, layer.window_kv)[0], layer.rope, batch.positions,
                     meta.window_slots)

    def compress(self, kv_proj: torch.Tensor, gate_proj: torch.Tensor, comp: Compression, layer: V4AttentionLayer,
                 kv: KVCache, batch: ForwardBatch, meta: TritonV4Metadata) -> None:
        compress(kv_proj, gate_proj, comp, layer, kv, batch, meta)

    def store_and_compress(self, kv_new: torch.Tensor, kv_proj: torch.Tensor, gate_proj: torch.Tensor,
                           comp: Compression, layer: V4AttentionLayer, kv: KVCache, batch: ForwardBatch,
                           meta: TritonV4Metadata, indexer: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        compress(kv_proj, gate_proj, comp, layer, kv, batch, meta, window=kv_new, indexer=indexer)  # one launch

    def store_compress_and_select(self, kv_new: torch.Tensor, kv_proj: torch.Tensor, gate_proj: torch.Tensor,
                                  comp: Compression, layer: V4AttentionLayer, kv: KVCache, batch: ForwardBatch,
                                  meta: TritonV4Metadata, indexer: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor,
                                  weights: torch.Tensor) -> torch.Tensor:
        if compress_select.fits(kv_proj.shape[0], comp, layer, meta):  # one launch
            return compress_select.compress_and_select(kv_new, kv_proj, gate_proj, comp, layer, kv, batch, meta,
                                                       indexer, q, weights)
        return super().store_compress_and_select(kv_new, kv_proj, gate_proj, comp, layer, kv, batch, meta, indexer,
                                                 q, weights)

    def select(self, q: torch.Tensor, weights: torch.Tensor, layer: V4AttentionLayer, kv: KVCache,
               batch: ForwardBatch, meta: TritonV4Metadata, candidates: torch.Tensor | None = None) -> torch.Tensor:
        return select(q, weights, layer, kv, batch, meta, candidates)

    def select_candidates(self, q: torch.Tensor, weights: torch.Tensor, layer: V4AttentionLayer, kv: KVCache,
                          batch: ForwardBatch, meta: TritonV4Metadata) -> torch.Tensor:
        return select_candidates(q, weights, layer, kv, batch, meta)

    def attend(self, q: torch.Tensor, layer: V4AttentionLayer, kv: KVCache, batch: ForwardBatch,
               meta: TritonV4Metadata, picks: torch.Tensor | None = None) -> torch.Tensor | MXFP8Tensor:
        return sparse_attention(q, layer, kv, batch, meta, picks, self.emits_mxfp8)


@triton.jit
def token_metadata_kernel(starts_ptr, slots_ptr, windows_ptr, token_seq_ptr, window_slots_ptr, num_tokens, num_seqs,
                          page_size, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr):
    """Tokens of block ``program_id(0)``: the sequence of each, the number of sequences whose tokens
    end at or before it (``searchsorted(starts[1:], t, right=True)``), and its slot in the window
    pages, ``windows[slot // page_size] * page_size + slot % page_size`` (slots are never negative)."""
    rt = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    live = rt < num_tokens
    rs0 = tl.arange(0, BLOCK_S)
    wait_for_prior(PDL)
    seq = tl.zeros((BLOCK_T,), dtype=tl.int32)
    for s0 in range(0, num_seqs, BLOCK_S):
        rs = s0 + rs0
        ends = tl.load(starts_ptr + 1 + rs, mask=rs < num_seqs, other=2147483647)
        seq += tl.sum((ends[None, :] <= rt[:, None]).to(tl.int32), axis=1)
    tl.store(token_seq_ptr + rt, seq, mask=live)
    slot = tl.load(slots_ptr + rt, mask=live, other=0)
    page = slot // page_size
    window = tl.load(windows_ptr + page, mask=live, other=0).to(tl.int64)
    tl.store(window_slots_ptr + rt, window * page_size + (slot - page * page_size), mask=live)


def token_metadata(query_start_loc: torch.Tensor, slot_mapping: torch.Tensor, windows: torch.Tensor,
                   page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each new token's sequence (int32 [T]) and window slot (int64 [T], as cache.window_slots gives
    it) in one launch, from the batch's query offsets [B + 1], slots [T] and the window table."""
    tokens, seqs = slot_mapping.shape[0], query_start_loc.shape[0] - 1
    token_seq = torch.empty(tokens, dtype=torch.int32, device=slot_mapping.device)
    slots = torch.empty(tokens, dtype=torch.int64, device=slot_mapping.device)
    if tokens:
        block_t = min(128, triton.next_power_of_2(tokens))
        token_metadata_kernel[(triton.cdiv(tokens, block_t),)](
            query_start_loc, slot_mapping, windows, token_seq, slots, tokens, seqs, page_size, BLOCK_T=block_t,
            BLOCK_S=min(64, triton.next_power_of_2(max(1, seqs))), **launch_options(slot_mapping.device))
    return token_seq, slots
