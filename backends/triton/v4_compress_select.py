"""A CSA layer's cache writes and its lightning indexer's top-k in one launch for a decode step:
``compress_kernel``'s programs (the window row, the layer's compressor, the indexer's compressor),
then ``index_topk_kernel``'s, which score the index keys the first ones have just written.

Programs take work by ticket, from an atomic counter, as gemv_chain.py's bands do: every compress
program (token t, role r) first, then every (token, split) of the indexer. A compress program runs
v4_compressor.py's program and counts itself into a flag (a barrier, then a release atomic at GPU
scope). An indexer program waits until the flag holds every compress program of the launch
(acquire): the entry a decode token closes is this step's, written by the indexer's compressor
program of that token, and waiting for all of them needs no map from entries to programs. It then
runs v4_indexer.py's (token, split) program, the last split of a token to arrive at the token's
counter running its top-k. It never deadlocks: a waiting program holds a larger ticket than every
compress program, so those were taken by programs already running, which never wait. The last
program to finish (an arrival count) sets the ticket, the flag and the count back to 0 for the
next launch and every graph replay; each token's counter is set back by its top-k.

Numerics are the two launches': the same programs, called as the same @triton.jit functions.
Prefill and steps that do not fit (``fits``) keep the two launches.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.core.families.v4_attention import Compression, V4AttentionLayer
from engine.core.forward import ForwardBatch
from engine.core.kv.storage import KVCache

from .attention_decode import arrival_counters
from .gemv import MAX_ROWS
from .pdl import launch_options, wait_for_prior
from .target import config_for
from .v4_compressor import compress_launch, compress_program
from .v4_indexer import (INDEXER, SCRATCH_BYTES, check_scoring, index_keys, index_topk_program, output_buffer,
                         scoring_chunks)

COUNTERS = tl.constexpr(3)  # the ticket, the flag, the arrival count; each token's top-k counter after them
# the launch's options beside its parts' warps: on gfx950 the scores' loop in two stages beside the compressor's
# programs leaves 36 bytes of scratch with E4M3 keys (scalar registers spilled), in one stage none
OPTIONS = {"gfx950": dict(num_stages=1), "default": {}}
# the scoring's arguments the compression passes too (the same tensors and values), and its candidates'
SHARED = ("keys_ptr", "scales_ptr", "cos_ptr", "sin_ptr", "positions_ptr", "token_seq_ptr", "page_table_ptr",
          "cand_ptr", "stride_key", "stride_cos", "stride_pt", "stride_c", "ROT_HALF", "RATE", "PAGE_SIZE",
          "NUM_CAND", "CAND_SIZE")


@triton.jit
def compress_select_kernel(
    kv_ptr, gate_ptr, kv_cache_ptr, gate_cache_ptr, entry_ptr, entry_scale_ptr, ape_ptr, norm_ptr, cos_ptr, sin_ptr,
    positions_ptr, token_seq_ptr, window_slots_ptr, window_table_ptr, page_table_ptr, query_start_ptr, latent_ptr, eps,
    stride_kv, stride_gate, stride_kvc, stride_gc, stride_entry, stride_entry_scale, stride_ape, stride_cos,
    stride_pt, stride_latent, win_ptr, win_norm_ptr, win_cache_ptr, stride_win, stride_wc, win_eps,
    ix_kv_ptr, ix_gate_ptr, ix_kv_cache_ptr, ix_gate_cache_ptr, ix_entry_ptr, ix_entry_scale_ptr, ix_ape_ptr,
    ix_norm_ptr, ix_eps, stride_ix_kv, stride_ix_gate, stride_ix_kvc, stride_ix_gc, stride_ix_entry,
    stride_ix_entry_scale, stride_ix_ape,
    sel_q_ptr, sel_w_ptr, sel_out_ptr, sel_max_entries, sel_sm_scale, sel_w_scale, stride_sel_qt, stride_sel_qh,
    stride_sel_wt, stride_sel_out, picks_ptr, stride_picks, counters_ptr, tokens,
    WIDTH: tl.constexpr, HEAD_DIM: tl.constexpr, ROPE_HALF: tl.constexpr, RATE: tl.constexpr,
    OVERLAP: tl.constexpr, NUM_SLOTS: tl.constexpr, PAGE_SIZE: tl.constexpr, ENTRIES_PER_PAGE: tl.constexpr,
    QUANTIZE: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    GATED: tl.constexpr, HAS_APE: tl.constexpr, LATENT: tl.constexpr, WINDOW: tl.constexpr, WIN_DIM: tl.constexpr,
    WIN_BLOCK: tl.constexpr, INDEXER: tl.constexpr, IX_WIDTH: tl.constexpr, IX_HEAD_DIM: tl.constexpr,
    IX_QUANTIZE: tl.constexpr, IX_BLOCK_W: tl.constexpr, IX_BLOCK_S: tl.constexpr, IX_BLOCK_D: tl.constexpr,
    SEL_NUM_HEADS: tl.constexpr, SEL_HEAD_DIM: tl.constexpr, SEL_SPLITS: tl.constexpr, SEL_HAS_SCALES: tl.constexpr,
    SEL_DOT_FP32: tl.constexpr, SEL_BLOCK_H: tl.constexpr, SEL_BLOCK_N: tl.constexpr, SEL_BLOCK_D: tl.constexpr,
    SEL_TOP_K: tl.constexpr, SEL_TOPK_BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    """``compress_kernel``'s arguments, then ``index_topk_kernel``'s that are not the same (``sel_``: the
    keys are the indexer's compression's entries, the rope, positions, sequences, page table, rate and
    page size the compression's; no candidates),
    ``tokens`` the step's: tokens x (1 + WINDOW + INDEXER) compress programs, then tokens x SEL_SPLITS
    indexer programs. counters: ``COUNTERS`` then one a token, all zero at the start and left so. A
    tensor both read is passed once: each argument takes scalar registers, which gfx950 runs short of."""
    wait_for_prior(PDL)
    roles: tl.constexpr = 1 + WINDOW + INDEXER
    writers = tokens * roles
    ticket = tl.atomic_add(counters_ptr, 1, sem="relaxed", scope="gpu")
    if ticket < writers:
        compress_program(
            (ticket // roles).to(tl.int64), ticket % roles, kv_ptr, gate_ptr, kv_cache_ptr, gate_cache_ptr, entry_ptr,
            entry_scale_ptr, ape_ptr, norm_ptr, cos_ptr, sin_ptr, positions_ptr, token_seq_ptr, window_slots_ptr,
            window_table_ptr, page_table_ptr, query_start_ptr, latent_ptr, eps, stride_kv, stride_gate, stride_kvc,
            stride_gc, stride_entry, stride_entry_scale, stride_ape, stride_cos, stride_pt, stride_latent, win_ptr,
            win_norm_ptr, win_cache_ptr, stride_win, stride_wc, win_eps, ix_kv_ptr, ix_gate_ptr, ix_kv_cache_ptr,
            ix_gate_cache_ptr, ix_entry_ptr, ix_entry_scale_ptr, ix_ape_ptr, ix_norm_ptr, ix_eps, stride_ix_kv,
            stride_ix_gate, stride_ix_kvc, stride_ix_gc, stride_ix_entry, stride_ix_entry_scale, stride_ix_ape,
            WIDTH, HEAD_DIM, ROPE_HALF, RATE, OVERLAP, NUM_SLOTS, PAGE_SIZE, ENTRIES_PER_PAGE, QUANTIZE, BLOCK_W,
            BLOCK_S, BLOCK_D, GATED, HAS_APE, LATENT, WINDOW, WIN_DIM, WIN_BLOCK, INDEXER, IX_WIDTH, IX_HEAD_DIM,
            IX_QUANTIZE, IX_BLOCK_W, IX_BLOCK_S, IX_BLOCK_D)
        tl.debug_barrier()  # every thread's stores before the release
        tl.atomic_add(counters_ptr + 1, 1, sem="release", scope="gpu")
    else:
        while tl.atomic_add(counters_ptr + 1, 0, sem="acquire", scope="gpu") < writers:
            pass
        token = ((ticket - writers) // SEL_SPLITS).to(tl.int64)
        index_topk_program(
            token, (ticket - writers) % SEL_SPLITS, counters_ptr + COUNTERS + token, sel_q_ptr, sel_w_ptr,
            ix_entry_ptr, ix_entry_scale_ptr, cos_ptr, sin_ptr, positions_ptr, token_seq_ptr, page_table_ptr,
            sel_out_ptr, token_seq_ptr, sel_max_entries, sel_sm_scale, sel_w_scale, stride_sel_qt, stride_sel_qh,
            stride_sel_wt, stride_ix_entry, stride_cos, stride_pt, stride_sel_out, 0, picks_ptr, stride_picks,
            SEL_NUM_HEADS, SEL_HEAD_DIM, ROPE_HALF, RATE, PAGE_SIZE, SEL_SPLITS, SEL_HAS_SCALES, SEL_DOT_FP32,
            SEL_BLOCK_H, SEL_BLOCK_N, SEL_BLOCK_D, SEL_TOP_K, SEL_TOPK_BLOCK, 0, 1)
    tl.debug_barrier()  # every thread done with the counters before the arrival
    if tl.atomic_add(counters_ptr + 2, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
        tl.store(counters_ptr, 0)
        tl.store(counters_ptr + 1, 0)
        tl.store(counters_ptr + 2, 0)


def fits(tokens: int, comp: Compression, layer: V4AttentionLayer, meta) -> bool:
    """Whether the one launch serves this step: a decode step's tokens (at most ``gemv.MAX_ROWS``, the
    decode launches' bound), a CSA layer whose indexer compresses its own keys and neither publishes
    nor takes candidates (the launch passes none), every token's scores in one chunk of the scratch."""
    indexer = layer.indexer
    return (0 < tokens <= MAX_ROWS and comp.index_key is None and indexer is not None
            and indexer.compression is not None and indexer.compression.index_key is None
            and not indexer.candidate_blocks and not indexer.filtered
            and tokens * 4 * max(1, meta.max_entries) <= SCRATCH_BYTES)


def compress_and_select(kv_new: torch.Tensor, kv_proj: torch.Tensor, gate_proj: torch.Tensor, comp: Compression,
                        layer: V4AttentionLayer, kv: KVCache, batch: ForwardBatch, meta,
                        indexer: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor,
                        weights: torch.Tensor) -> torch.Tensor:
    """``store_and_compress`` with the CSA ``indexer``'s projections, then ``select`` of q [T, Hi, di]
    and weights [T, Hi] over the keys it wrote, in one launch -> int32 [T, top_k], as the two give."""
    tokens = kv_proj.shape[0]
    if not fits(tokens, comp, layer, meta) or q.shape[0] != tokens:
        raise ValueError(f"{tokens} tokens (queries for {q.shape[0]}) of a layer whose indexer "
                         f"{'is absent' if layer.indexer is None else 'filters candidates or derives its keys'}"
                         f" or whose compression derives index keys, or past {MAX_ROWS} tokens: run compress and "
                         f"select apart")
    launch = compress_launch(kv_proj, gate_proj, comp, layer, kv, batch, meta, window=kv_new, indexer=indexer)
    keys, scales = index_keys(layer, q, kv)
    check_scoring(q, weights, keys, scales, layer.rope.cos)
    ix = layer.indexer
    cfg = config_for(INDEXER, q.device)
    ((_, _, _, args, constexprs),) = scoring_chunks(q, weights, ix.num_heads ** -0.5, keys, scales, layer.rope.cos,
                                                    layer.rope.sin, batch.positions, meta.token_seq,
                                                    batch.page_table, batch.page_size, ix.compression.rate,
                                                    meta.max_entries, cfg)
    picks = output_buffer((tokens, ix.top_k), torch.int32, q.device)
    selection = {f"stride_sel_{k[7:]}" if k.startswith("stride_") else f"sel_{k}": v for k, v in args.items()
                 if k not in SHARED}
    compress_select_kernel[(tokens * launch.roles + tokens * constexprs["SPLITS"],)](
        *launch.args, **selection, picks_ptr=picks, stride_picks=picks.stride(0),
        counters_ptr=arrival_counters(COUNTERS.value + tokens, q.device), tokens=tokens, **launch.constexprs,
        **{f"SEL_{k}": v for k, v in constexprs.items() if k not in SHARED}, SEL_TOP_K=ix.top_k,
        SEL_TOPK_BLOCK=cfg.topk_block, num_warps=max(launch.num_warps, cfg.num_warps), **config_for(OPTIONS, q.device),
        enable_fp_fusion=False,  # a fused multiply-add skips a rounding step of either
        **launch_options(q.device))
    return picks
