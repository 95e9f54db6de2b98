"""Paged decode attention, split-KV (flash-decoding): one new query per sequence over its pages,
or a fixed few (``query_len``, speculative decoding's verify steps of K+1 tokens), causal among them.

A decode step has few queries and long key ranges, so one program per sequence and KV head
leaves most of the chip idle. The visible keys of each sequence are cut into ``num_splits``
ranges of whole key blocks; each (sequence, KV head block, split) program attends the query heads
of that block over its range and writes a partial output with its log-sum-exp. One launch does
it all: the program that arrives last at its (sequence, KV head block) counter combines the
splits (and the sink logit, which belongs to no split) into the output, so at batch 1 a layer
pays one launch, not two. A range that fits one split (short sequences, graph padding) is
written as the output directly, and splits past the end of a short sequence do nothing.

With ``query_len`` > 1 every sequence brings that many queries, row i of q being query i %
query_len of sequence i // query_len; each query is a row of the grid as a decode sequence is,
over its keys up to its own position. The keys are read once per query (SGLang's target-verify
kernels share them among a sequence's queries; not done here).

The number of splits depends only on the batch size, never on sequence lengths, so a captured
graph's grid holds across replays; the counters live in one zeroed buffer per device that every
launch leaves zeroed. Launches on one device must not overlap (they share the counters), which
holds for the one stream a model runs on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.core.families.attention import AttentionLayer, LayerKV

from .attention_prefill import LOG2E, pick_dim
from .pdl import launch_options, wait_for_prior
from .target import config_for


@dataclass(frozen=True)
class DecodeConfig:
    block_n: int  # keys per inner step
    block_h: int  # query heads per program (at least 16, the smallest tl.dot)
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class DecodeTuning:
    per_dim: dict[int, DecodeConfig]  # keyed by the padded head dim (the larger of head_dim and v_head_dim)
    min_programs: int  # split while the grid stays within this many programs (a few per SM/CU)
    max_splits: int


D = DecodeConfig
DECODE = {  # sm_90 measured on an H200 (bf16, graph replay, benchmarks/decode_attention_sweep.py); others guessed
    "sm_90": DecodeTuning({64: D(64, 64, 4, 2), 128: D(64, 64, 4, 2), 256: D(32, 32, 4, 2), 512: D(32, 64, 4, 2)},
                          min_programs=132 * 4, max_splits=32),
    "sm_100": DecodeTuning({64: D(64, 64, 4, 2), 128: D(64, 64, 4, 2), 256: D(32, 32, 4, 2), 512: D(32, 64, 4, 2)},
                           min_programs=148 * 4, max_splits=32),
    "gfx942": DecodeTuning({64: D(64, 64, 4, 1), 128: D(64, 64, 4, 1), 256: D(32, 32, 4, 1), 512: D(32, 32, 4, 1)},
                           min_programs=304 * 2, max_splits=64),
    "gfx950": DecodeTuning({64: D(64, 64, 4, 1), 128: D(64, 64, 4, 1), 256: D(32, 32, 4, 1), 512: D(32, 32, 4, 1)},
                           min_programs=256 * 2, max_splits=64),
    "default": DecodeTuning({64: D(32, 16, 4, 1), 128: D(32, 16, 4, 1), 256: D(16, 16, 4, 1), 512: D(16, 16, 4, 1)},
                            min_programs=16, max_splits=4),
}


COMBINE_TILE = 4096  # partial values per combine step: 32 fp32 registers a thread at 4 warps


def num_splits_for(tuning: DecodeTuning, num_seqs: int, programs_per_seq: int) -> int:
    """Splits that bring the grid to at most about ``min_programs``: on the H200 one program more per
    SM than that (batch 32 at 3 splits instead of 2) cost a fifth of the bandwidth."""
    return max(1, min(tuning.max_splits, tuning.min_programs // max(1, num_seqs * programs_per_seq)))


_KEPT_ZERO: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}


def kept_zero(n: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """At least ``n`` zeroed values of ``dtype`` on ``device``, the same buffer every launch that fits.

    Each launch that takes it leaves it at zero, so the buffer is made once and never cleared. It
    grows to a power of two on demand, outside graph capture only; the graph runner warms every
    batch size eagerly, largest first, so its warm-up makes the buffer. A grown-out buffer is kept:
    graphs captured earlier still use it."""
    held = _KEPT_ZERO.setdefault((device, dtype), [])
    if not held or held[-1].numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"a launch needs {n} zeroed {dtype} values on {device} while a CUDA graph is being "
                               "captured; run the captured batch size once eagerly first")
        held.append(torch.zeros(triton.next_power_of_2(n), dtype=dtype, device=device))
    return held[-1]


def arrival_counters(n: int, device: torch.device) -> torch.Tensor:
    """At least ``n`` int32 arrival counters at zero on ``device`` (``kept_zero``)."""
    return kept_zero(n, device, torch.int32)


@triton.jit
def _write_output(out_ptr, sinks_ptr, tok, head, h_ok, acc, m_i, l_i, stride_ot, stride_oh,
                  V_HEAD_DIM: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_SINKS: tl.constexpr):
    """The output of heads ``head`` from one range that held every key: ``acc`` unnormalized."""
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head, mask=h_ok, other=0.0) * LOG2E
        m = tl.maximum(m_i, sink)
        rescale = tl.exp2(m_i - m)
        acc = acc * rescale[:, None]
        l_i = l_i * rescale + tl.exp2(sink - m)
    offs_dv = tl.arange(0, BLOCK_DV)
    tl.store(out_ptr + tok * stride_ot + head[:, None] * stride_oh + offs_dv[None, :],
             (acc / l_i[:, None]).to(out_ptr.dtype.element_ty),
             mask=h_ok[:, None] & (offs_dv[None, :] < V_HEAD_DIM))


@triton.jit
def _combine_splits(part_out_ptr, part_lse_ptr, out_ptr, sinks_ptr, first, used, tok, h_lo, h_hi,
                    stride_ot, stride_oh, NUM_SPLITS: tl.constexpr, V_HEAD_DIM: tl.constexpr,
                    BLOCK_S: tl.constexpr, SUB_G: tl.constexpr, CHUNK_S: tl.constexpr, BLOCK_DV: tl.constexpr,
                    HAS_SINKS: tl.constexpr):
    """The outputs of heads [h_lo, h_hi) from the partials of their first ``used`` splits (and sinks).

    One program does this alone while the rest of the chip waits on it, so it loads wide tiles of
    SUB_G heads by CHUNK_S splits: a head or a split at a time is a chain of dependent memory
    round trips that costs more than the whole split pass."""
    splits = tl.arange(0, BLOCK_S)
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_ok = offs_dv < V_HEAD_DIM
    for h0 in range(h_lo, h_hi, SUB_G):
        head = h0 + tl.arange(0, SUB_G)
        h_ok = head < h_hi
        row = first + head * NUM_SPLITS
        lse = tl.load(part_lse_ptr + row[:, None] + splits[None, :],
                      mask=h_ok[:, None] & (splits[None, :] < used), other=float("-inf"))
        m = tl.where(h_ok, tl.max(lse, 1), 0.0)  # finite: every used split holds at least one key
        if HAS_SINKS:
            sink = tl.load(sinks_ptr + head, mask=h_ok, other=0.0) * LOG2E
            m = tl.maximum(m, sink)
        denom = tl.sum(tl.exp2(lse - m[:, None]), 1)
        if HAS_SINKS:
            denom += tl.exp2(sink - m)
        denom = tl.where(h_ok, denom, 1.0)
        o = tl.zeros([SUB_G, BLOCK_DV], tl.float32)
        for s0 in range(0, used, CHUNK_S):
            chunk = s0 + tl.arange(0, CHUNK_S)
            ok = h_ok[:, None] & (chunk[None, :] < used)
            part = row[:, None] + chunk[None, :]
            w = tl.exp2(tl.load(part_lse_ptr + part, mask=ok, other=float("-inf")) - m[:, None])
            parts = tl.load(part_out_ptr + part[:, :, None] * V_HEAD_DIM + offs_dv[None, None, :],
                            mask=ok[:, :, None] & dv_ok[None, None, :], other=0.0)
            o += tl.sum(parts * w[:, :, None], 1)
        tl.store(out_ptr + tok * stride_ot + head[:, None] * stride_oh + offs_dv[None, :],
                 (o / denom[:, None]).to(out_ptr.dtype.element_ty), mask=h_ok[:, None] & dv_ok[None, :])


# the page-table row stride is the batch's widest page count: specialized on it, a kernel would
# compile again whenever a step's longest context crossed into another class (1 page, 16k pages)
@triton.jit(do_not_specialize=["stride_pt"])
def decode_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, sinks_ptr, part_out_ptr, part_lse_ptr, counters_ptr,
    page_table_ptr, query_start_ptr, seq_lens_ptr, seq_ids_ptr,
    stride_qt, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_pt,
    stride_ot, stride_oh, qk_scale, window,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, V_HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr, HEAD_BLOCKS: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_S: tl.constexpr, SUB_G: tl.constexpr, CHUNK_S: tl.constexpr, SLIDING: tl.constexpr, HAS_SINKS: tl.constexpr,
    ALL_DECODE: tl.constexpr, QUERY_LEN: tl.constexpr, CAUSAL: tl.constexpr, PDL: tl.constexpr,
):
    i = tl.program_id(0)
    kv_head = tl.program_id(1) // HEAD_BLOCKS
    split = tl.program_id(2)
    wait_for_prior(PDL)
    # a pure decode batch (every graph replay) is row i = sequence i: two dependent loads fewer
    seq = i // QUERY_LEN if ALL_DECODE else tl.load(seq_ids_ptr + i)
    seq_len = tl.load(seq_lens_ptr + seq)
    if CAUSAL:  # query i % QUERY_LEN of its sequence's new tokens sees the keys up to its own
        seq_len -= QUERY_LEN - 1 - i % QUERY_LEN

    # the query sits at seq_len - 1: it sees every key below seq_len that the window keeps. The
    # splits cut that range in whole key blocks, so a short one fills only the first ``used``
    # splits; the others have nothing to do, not even arriving.
    lo = tl.maximum(seq_len - window, 0) if SLIDING else 0
    per_split = tl.cdiv(tl.cdiv(seq_len - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    used = tl.cdiv(seq_len - lo, per_split)
    if split < used:
        tok = i if ALL_DECODE else tl.load(query_start_ptr + seq)
        g0 = (tl.program_id(1) % HEAD_BLOCKS) * BLOCK_H
        g = g0 + tl.arange(0, BLOCK_H)
        h_ok = g < GROUP
        head = kv_head * GROUP + g
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        q = tl.load(q_ptr + tok * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                    mask=h_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
        start = lo + split * per_split
        end = tl.minimum(start + per_split, seq_len)

        m_i = tl.full([BLOCK_H], -1.0e30, tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
        pages_row = page_table_ptr + seq * stride_pt
        for n0 in range(start, end, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            n_ok = n < end
            page = tl.load(pages_row + n // PAGE_SIZE, mask=n_ok, other=0).to(tl.int64)
            slot = n % PAGE_SIZE
            k = tl.load(k_ptr + page[None, :] * stride_kp + slot[None, :] * stride_ks + kv_head * stride_kh
                        + offs_d[:, None], mask=n_ok[None, :] & (offs_d[:, None] < HEAD_DIM), other=0.0)
            s = tl.where(n_ok[None, :], tl.dot(q, k) * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + page[:, None] * stride_vp + slot[:, None] * stride_vs + kv_head * stride_vh
                        + offs_dv[None, :], mask=n_ok[:, None] & (offs_dv[None, :] < V_HEAD_DIM), other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new

        if NUM_SPLITS == 1 or used == 1:  # this program saw every key
            _write_output(out_ptr, sinks_ptr, tok, head, h_ok, acc, m_i, l_i, stride_ot, stride_oh,
                          V_HEAD_DIM, BLOCK_DV, HAS_SINKS)
        else:
            part = (i * NUM_HEADS + head) * NUM_SPLITS + split
            tl.store(part_lse_ptr + part, m_i + tl.log2(l_i), mask=h_ok)
            tl.store(part_out_ptr + part[:, None] * V_HEAD_DIM + offs_dv[None, :], acc / l_i[:, None],
                     mask=h_ok[:, None] & (offs_dv[None, :] < V_HEAD_DIM))
            # a scalar atomic runs on one thread and its old value is broadcast to all: the barrier
            # orders every thread's partials before that thread's release. The last program to
            # arrive acquires them all, combines, and leaves the counter at 0 for the next launch
            # (and every graph replay).
            tl.debug_barrier()
            counter = counters_ptr + i * tl.num_programs(1) + tl.program_id(1)
            if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == used - 1:
                _combine_splits(part_out_ptr, part_lse_ptr, out_ptr, sinks_ptr, i * NUM_HEADS * NUM_SPLITS, used, tok,
                                kv_head * GROUP + g0, kv_head * GROUP + tl.minimum(g0 + BLOCK_H, GROUP),
                                stride_ot, stride_oh, NUM_SPLITS, V_HEAD_DIM, BLOCK_S, SUB_G, CHUNK_S, BLOCK_DV,
                                HAS_SINKS)
                tl.store(counter, 0)


def combine_tile(group_rows: int, splits: int, block_dv: int) -> tuple[int, int]:
    """Heads and splits per combine step: tiles of at most COMBINE_TILE partial values."""
    sub_g = min(group_rows, max(1, COMBINE_TILE // block_dv))
    return sub_g, min(triton.next_power_of_2(splits), max(1, COMBINE_TILE // (sub_g * block_dv)))


def decode_attention(q: torch.Tensor, kv: LayerKV, layer: AttentionLayer, out: torch.Tensor,
                     page_table: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                     seq_ids: torch.Tensor | None, config: DecodeConfig | None = None,
                     splits: int | None = None, query_len: int = 1) -> None:
    """Attend the one new query of each sequence in ``seq_ids`` (its row ``query_start_loc[seq]``
    of q and out) over its first ``seq_lens`` keys in ``kv``'s pages; ``seq_ids`` None: every
    sequence has ``query_len`` queries, rows i * query_len.. of q being sequence i's. ``config`` and
    ``splits`` override the tuning table (the tuning sweep passes each candidate)."""
    if query_len > 1 and seq_ids is not None:
        raise ValueError("several queries a sequence need every sequence to bring them (seq_ids None)")
    num_seqs = seq_lens.shape[0] * query_len if seq_ids is None else seq_ids.shape[0]
    if num_seqs == 0:
        return
    head_dim, v_head_dim = kv.k.shape[-1], kv.v.shape[-1]
    group = layer.num_heads // layer.num_kv_heads
    tuning = config_for(DECODE, q.device)
    cfg = config or pick_dim(tuning.per_dim, max(head_dim, v_head_dim))
    block_h = max(16, min(cfg.block_h, triton.next_power_of_2(group)))
    head_blocks = triton.cdiv(group, block_h)
    splits = splits or num_splits_for(tuning, num_seqs, layer.num_kv_heads * head_blocks)
    block_dv = triton.next_power_of_2(v_head_dim)
    sub_g, chunk_s = combine_tile(min(block_h, triton.next_power_of_2(group)), splits, block_dv)
    grid = (num_seqs, layer.num_kv_heads * head_blocks, splits)
    part_out = part_lse = counters = None  # one split writes the output itself
    if splits > 1:
        part_out = torch.empty(num_seqs, layer.num_heads, splits, v_head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(num_seqs, layer.num_heads, splits, dtype=torch.float32, device=q.device)
        counters = arrival_counters(grid[0] * grid[1], q.device)
    decode_attention_kernel[grid](
        q, kv.k, kv.v, out, layer.sinks, part_out, part_lse, counters,
        page_table, query_start_loc, seq_lens, seq_ids,
        q.stride(0), q.stride(1), kv.k.stride(0), kv.k.stride(1), kv.k.stride(2),
        kv.v.stride(0), kv.v.stride(1), kv.v.stride(2), page_table.stride(0), out.stride(0), out.stride(1),
        layer.scale * LOG2E.value, layer.sliding_window or 0,
        NUM_HEADS=layer.num_heads, GROUP=group, HEAD_DIM=head_dim, V_HEAD_DIM=v_head_dim,
        PAGE_SIZE=kv.k.shape[1], NUM_SPLITS=splits, HEAD_BLOCKS=head_blocks,
        BLOCK_H=block_h, BLOCK_N=cfg.block_n,
        BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_DV=block_dv,
        BLOCK_S=triton.next_power_of_2(splits), SUB_G=sub_g, CHUNK_S=chunk_s,
        SLIDING=layer.sliding_window is not None, HAS_SINKS=layer.sinks is not None, ALL_DECODE=seq_ids is None,
        QUERY_LEN=query_len, CAUSAL=layer.causal,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_options(q.device),
    )
