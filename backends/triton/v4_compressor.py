"""DeepSeek-V4's compressors over a whole step in one launch: store the projections, pool the windows
that close.

Program t stores token t's kv and gate projections [width] at its window slot, rounded to the
cache dtype. If its position p closes a window ((p + 1) % rate == 0) it then pools window
w = (p + 1) // rate - 1 into entry w, all ``head_dim`` channels in the one program so that the
RMSNorm sees the whole entry: in decode this is the token that completes a window whose first
tokens came in earlier steps, in prefill one token in every ``rate``. A window's tokens that the
step brings are read from the step's projections (rounded as the store rounds them), the earlier
ones from the window pages, so no program reads what another writes. With ``overlap`` (CSA) entry
w pools window w-1's first half of the channels beside window w's second half; window 0 has no
predecessor and those slots weigh nothing.

Rounding follows core/native/compressor.py and core/native/v4_attention.py: the gate plus the
fp32 ``ape`` in fp32, the softmax over the pooled slots per channel in fp32 (its maximum and sum
in a first pass over the slots, online where the window takes several tiles), each weight rounded
to the cache dtype, each product rounded to it, their sum taken in fp32 and rounded once; the
RMSNorm's statistics in fp32 with the fp32 weight, rounded once; the rotation of the entry's rope
tail (interleaved pairs, cos/sin of the window's first position rounded to the cache dtype) in
fp32, rounded once. Where the entries layer keeps E4M3 (the indexer's keys beside FP8 weights) that
rounded entry is quantized in the same program as fp8_quant.py quantizes a group of 128: one fp32
scale per entry, amax / 448, kept beside it.

DeepSeek-V4.1's CSA2 KV sources use the same launch: at rate 2 two slots with no position bias, at
rate 1 no gate and no projections (each token's kv row, normalised and rotated, is its entry).
One that indexes also derives index keys from its entries: the launch keeps each closing token's
latent (normalised, not rotated) in a scratch row, the index-key projection runs over those rows
as a GEMM, and ``index_key_kernel`` normalises, rotates and keeps each key as the entry is kept.

Given the layer's window KV too (``compress(..., window=)``), the launch has a second program per
token, (t, 1), which stores token t's window row as v4_window.py's store does, so the layer's
window store costs no launch of its own (and, a program apart, no registers of the pooling's).
Given a CSA layer's indexer projections too (``compress(..., indexer=)``), one more program per
token runs the indexer's compressor (same rate, overlapping windows and rope, its own width, head
dim, cache layers and E4M3 keys) as its own launch would, so the two compressors share a launch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.core.families.v4_attention import Compression, V4AttentionLayer
from engine.core.forward import ForwardBatch
from engine.core.kv.storage import KVCache
from engine.core.models.deepseek_v4.cache import entries_of, flat

from .fp8_quant import FP8_MAX, e4m3_rne
from .pdl import launch_options, wait_for_prior
from .target import config_for
from .v4_window import check_window, window_rows


@dataclass(frozen=True)
class CompressConfig:
    tile_elements: int  # slots x channels of one tile of a window: the slots per tile follow from the head dim
    elements_per_warp: int  # a tile's elements per warp: the warps follow from the tile
    max_warps: int


COMPRESS = {  # V4-Flash, sm_90: HCA 8 tiles of 16 slots x 512 channels on 8 warps (128 registers), CSA one tile of
    # 8 slots on 4 warps, the indexer's on 1; the registers a pooling program needs set how many store-only ones fit
    "cuda": CompressConfig(tile_elements=8192, elements_per_warp=1024, max_warps=8),
    "hip": CompressConfig(tile_elements=8192, elements_per_warp=2048, max_warps=8),
    "default": CompressConfig(tile_elements=1 << 20, elements_per_warp=1 << 30, max_warps=1),  # the interpreter
}


@triton.jit
def _load_slots(src_ptr, stride_src, cache_ptr, stride_cache, rows, slots, fresh, cached, cols, channels):
    """A tile [slots, channels] of one projection in the cache dtype: the step's rows where ``fresh``,
    the window pages where ``cached``, zero elsewhere."""
    dt = cache_ptr.dtype.element_ty
    m_fresh = fresh[:, None] & channels[None, :]
    m_cached = cached[:, None] & channels[None, :]
    new = tl.load(src_ptr + rows[:, None] * stride_src + cols, mask=m_fresh, other=0.0).to(dt)
    old = tl.load(cache_ptr + slots[:, None] * stride_cache + cols, mask=m_cached, other=0.0)
    return tl.where(m_fresh, new, old)


@triton.jit
def _gate_tile(gate_ptr, stride_gate, gate_cache_ptr, stride_gc, ape_ptr, stride_ape, pages, window_table_ptr,
               j, first_q, row0, ctx, ch, ch_mask,
               RATE: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SLOTS: tl.constexpr, PAGE_SIZE: tl.constexpr,
               HAS_APE: tl.constexpr):
    """Pooled slots ``j`` of the window: the gate plus ``ape`` in fp32 [len(j), BLOCK_D] (-inf where
    there is no slot), and where the slots are, for their kv. Slot j holds position first_q + j, a
    row of the step (``fresh``) or a window-page slot (``cached``); with overlap the later window's
    slots (j >= RATE) read the second half of the channels."""
    q = first_q + j
    valid = (j < NUM_SLOTS) & (q >= 0)
    fresh = valid & (q >= ctx)
    cached = valid & (q < ctx)
    rows = row0 + q - ctx
    page = tl.load(pages + q // PAGE_SIZE, mask=cached, other=0)
    slots = tl.load(window_table_ptr + page, mask=cached, other=0).to(tl.int64) * PAGE_SIZE + q % PAGE_SIZE
    cols = ((j // RATE) * HEAD_DIM)[:, None] + ch[None, :]
    gate = _load_slots(gate_ptr, stride_gate, gate_cache_ptr, stride_gc, rows, slots, fresh, cached, cols, ch_mask)
    present = valid[:, None] & ch_mask[None, :]
    g = gate.to(tl.float32)
    if HAS_APE:
        g += tl.load(ape_ptr + (j % RATE)[:, None] * stride_ape + cols, mask=present, other=0.0)
    return tl.where(present, g, float("-inf")), rows, slots, fresh, cached, cols


@triton.jit
def _rms_normed(x, norm_ptr, ch, ch_mask, eps, dt: tl.constexpr, HEAD_DIM: tl.constexpr):
    """x [BLOCK_D] fp32 (0 past the head dim) normalised with the fp32 weight, rounded once to ``dt``."""
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / HEAD_DIM + eps)
    scale = tl.load(norm_ptr + ch, mask=ch_mask, other=0.0)
    return (scale * (x * inv_rms)).to(dt)


@triton.jit
def _keep(normed, p, pages, entry_ptr, entry_scale_ptr, cos_ptr, sin_ptr, stride_entry, stride_entry_scale,
          stride_cos, ch, ch_mask,
          HEAD_DIM: tl.constexpr, ROPE_HALF: tl.constexpr, RATE: tl.constexpr, PAGE_SIZE: tl.constexpr,
          ENTRIES_PER_PAGE: tl.constexpr, QUANTIZE: tl.constexpr, BLOCK_D: tl.constexpr):
    """Entry w = (p + 1) // RATE - 1 (its window closed by position p) from ``normed`` [BLOCK_D] in its
    dtype: rotated at the window's first position, rounded, and kept in the page of position p, as
    E4M3 with its scale where ``QUANTIZE``."""
    dt = normed.dtype
    w = (p + 1) // RATE - 1
    x1, x2 = tl.split(tl.reshape(normed, (BLOCK_D // 2, 2)))
    pair = tl.arange(0, BLOCK_D // 2) - (HEAD_DIM // 2 - ROPE_HALF)  # index into cos/sin; < 0: not rotated
    turn = (pair >= 0) & (pair < ROPE_HALF)
    cos = tl.load(cos_ptr + (w * RATE) * stride_cos + pair, mask=turn, other=1.0).to(dt).to(tl.float32)
    sin = tl.load(sin_ptr + (w * RATE) * stride_cos + pair, mask=turn, other=0.0).to(dt).to(tl.float32)
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    o1 = tl.where(turn, f1 * cos - f2 * sin, f1).to(dt)
    o2 = tl.where(turn, f2 * cos + f1 * sin, f2).to(dt)
    entry = tl.reshape(tl.join(o1, o2), (BLOCK_D,))

    page_index = p // PAGE_SIZE  # the page of the window's last token keeps its entry
    page = tl.load(pages + page_index).to(tl.int64)
    entry_slot = page * ENTRIES_PER_PAGE + w - (page_index * PAGE_SIZE) // RATE
    if QUANTIZE:  # E4M3 with one scale: amax / 448 (1 for a zero entry), divisions correctly rounded
        x = tl.where(ch_mask, entry.to(tl.float32), 0.0)
        amax = tl.max(tl.abs(x), axis=0)
        scale = tl.where(amax > 0, tl.math.div_rn(amax, FP8_MAX), 1.0)
        y = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FP8_MAX), FP8_MAX)
        tl.store(entry_ptr + entry_slot * stride_entry + ch, e4m3_rne(y), mask=ch_mask)
        tl.store(entry_scale_ptr + entry_slot * stride_entry_scale, scale)
    else:
        tl.store(entry_ptr + entry_slot * stride_entry + ch, entry.to(entry_ptr.dtype.element_ty), mask=ch_mask)


@triton.jit
def _compress_token(
    t, kv_ptr, gate_ptr, kv_cache_ptr, gate_cache_ptr, entry_ptr, entry_scale_ptr, ape_ptr, norm_ptr, cos_ptr,
    sin_ptr, positions_ptr, token_seq_ptr, window_slots_ptr, window_table_ptr, page_table_ptr, query_start_ptr,
    latent_ptr, eps, stride_kv, stride_gate, stride_kvc, stride_gc, stride_entry, stride_entry_scale, stride_ape,
    stride_cos, stride_pt, stride_latent,
    WIDTH: tl.constexpr, HEAD_DIM: tl.constexpr, ROPE_HALF: tl.constexpr, RATE: tl.constexpr,
    OVERLAP: tl.constexpr, NUM_SLOTS: tl.constexpr, PAGE_SIZE: tl.constexpr, ENTRIES_PER_PAGE: tl.constexpr,
    QUANTIZE: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    GATED: tl.constexpr, HAS_APE: tl.constexpr, LATENT: tl.constexpr,
):
    """Token t of one compression: its projections stored, and the entry of the window it closes."""
    dt = kv_cache_ptr.dtype.element_ty
    cw = tl.arange(0, BLOCK_W)
    w_mask = cw < WIDTH
    kv_row = tl.load(kv_ptr + t * stride_kv + cw, mask=w_mask)
    if GATED:
        slot = tl.load(window_slots_ptr + t)
        gate_row = tl.load(gate_ptr + t * stride_gate + cw, mask=w_mask)
        tl.store(kv_cache_ptr + slot * stride_kvc + cw, kv_row.to(dt), mask=w_mask)
        tl.store(gate_cache_ptr + slot * stride_gc + cw, gate_row.to(dt), mask=w_mask)

    p = tl.load(positions_ptr + t)
    s = tl.load(token_seq_ptr + t).to(tl.int64)  # beside p, not after it: one round trip less to a pooling
    pages = page_table_ptr + s * stride_pt
    ch = tl.arange(0, BLOCK_D)
    ch_mask = ch < HEAD_DIM
    if not GATED:  # BLOCK_W == BLOCK_D: the row is the entry's channels, in the projection's dtype
        normed = _rms_normed(tl.where(ch_mask, kv_row.to(tl.float32), 0.0), norm_ptr, ch, ch_mask, eps,
                             kv_row.dtype, HEAD_DIM)
        if LATENT:
            tl.store(latent_ptr + t * stride_latent + ch, normed, mask=ch_mask)
        _keep(normed, p, pages, entry_ptr, entry_scale_ptr, cos_ptr, sin_ptr, stride_entry, stride_entry_scale,
              stride_cos, ch, ch_mask, HEAD_DIM, ROPE_HALF, RATE, PAGE_SIZE, ENTRIES_PER_PAGE, QUANTIZE, BLOCK_D)
    elif (p + 1) % RATE == 0:
        w = (p + 1) // RATE - 1
        row0 = tl.load(query_start_ptr + s).to(tl.int64)
        ctx = p - (t - row0)  # the sequence's first position in this step
        first_q = (w - OVERLAP) * RATE

        m = tl.full([BLOCK_D], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_D], tl.float32)
        for j0 in range(0, NUM_SLOTS, BLOCK_S):  # a loop, not unrolled: unrolled tiles spill registers
            g, rows, slots, fresh, cached, cols = _gate_tile(
                gate_ptr, stride_gate, gate_cache_ptr, stride_gc, ape_ptr, stride_ape, pages, window_table_ptr,
                j0 + tl.arange(0, BLOCK_S), first_q, row0, ctx, ch, ch_mask, RATE, HEAD_DIM, NUM_SLOTS, PAGE_SIZE,
                HAS_APE)
            m_new = tl.maximum(m, tl.max(g, axis=0))
            base = tl.where(m_new == float("-inf"), 0.0, m_new)  # a tile of absent slots adds nothing
            total = total * tl.exp(m - base) + tl.sum(tl.exp(g - base[None, :]), axis=0)
            m = m_new
        base = tl.where(m == float("-inf"), 0.0, m)
        total = tl.where(ch_mask, total, 1.0)  # channels past the head dim pool nothing
        acc = tl.zeros([BLOCK_D], tl.float32)
        for j0 in range(0, NUM_SLOTS, BLOCK_S):
            g, rows, slots, fresh, cached, cols = _gate_tile(
                gate_ptr, stride_gate, gate_cache_ptr, stride_gc, ape_ptr, stride_ape, pages, window_table_ptr,
                j0 + tl.arange(0, BLOCK_S), first_q, row0, ctx, ch, ch_mask, RATE, HEAD_DIM, NUM_SLOTS, PAGE_SIZE,
                HAS_APE)
            kv = _load_slots(kv_ptr, stride_kv, kv_cache_ptr, stride_kvc, rows, slots, fresh, cached, cols, ch_mask)
            weight = (tl.exp(g - base[None, :]) / total[None, :]).to(dt).to(tl.float32)
            acc += tl.sum((kv.to(tl.float32) * weight).to(dt).to(tl.float32), axis=0)

        pooled = tl.where(ch_mask, acc.to(dt).to(tl.float32), 0.0)
        normed = _rms_normed(pooled, norm_ptr, ch, ch_mask, eps, dt, HEAD_DIM)
        if LATENT:
            tl.store(latent_ptr + t * stride_latent + ch, normed, mask=ch_mask)
        _keep(normed, p, pages, entry_ptr, entry_scale_ptr, cos_ptr, sin_ptr, stride_entry, stride_entry_scale,
              stride_cos, ch, ch_mask, HEAD_DIM, ROPE_HALF, RATE, PAGE_SIZE, ENTRIES_PER_PAGE, QUANTIZE, BLOCK_D)


@triton.jit
def compress_kernel(
    kv_ptr, gate_ptr, kv_cache_ptr, gate_cache_ptr, entry_ptr, entry_scale_ptr, ape_ptr, norm_ptr, cos_ptr, sin_ptr,
    positions_ptr, token_seq_ptr, window_slots_ptr, window_table_ptr, page_table_ptr, query_start_ptr, latent_ptr, eps,
    stride_kv, stride_gate, stride_kvc, stride_gc, stride_entry, stride_entry_scale, stride_ape, stride_cos,
    stride_pt, stride_latent, win_ptr, win_norm_ptr, win_cache_ptr, stride_win, stride_wc, win_eps,
    ix_kv_ptr, ix_gate_ptr, ix_kv_cache_ptr, ix_gate_cache_ptr, ix_entry_ptr, ix_entry_scale_ptr, ix_ape_ptr,
    ix_norm_ptr, ix_eps, stride_ix_kv, stride_ix_gate, stride_ix_kvc, stride_ix_gc, stride_ix_entry,
    stride_ix_entry_scale, stride_ix_ape,
    WIDTH: tl.constexpr, HEAD_DIM: tl.constexpr, ROPE_HALF: tl.constexpr, RATE: tl.constexpr,
    OVERLAP: tl.constexpr, NUM_SLOTS: tl.constexpr, PAGE_SIZE: tl.constexpr, ENTRIES_PER_PAGE: tl.constexpr,
    QUANTIZE: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
    GATED: tl.constexpr = True, HAS_APE: tl.constexpr = True, LATENT: tl.constexpr = False,
    WINDOW: tl.constexpr = False, WIN_DIM: tl.constexpr = 1, WIN_BLOCK: tl.constexpr = 1,
    INDEXER: tl.constexpr = False, IX_WIDTH: tl.constexpr = 1, IX_HEAD_DIM: tl.constexpr = 1,
    IX_QUANTIZE: tl.constexpr = False, IX_BLOCK_W: tl.constexpr = 1, IX_BLOCK_S: tl.constexpr = 1,
    IX_BLOCK_D: tl.constexpr = 2,
):
    # GATED: pooled by the gate (else rate 1: the kv row is the entry, and there are no projections
    # to keep); HAS_APE: the gate's position bias; LATENT: keep each entry's latent in row t of latent_ptr;
    # WINDOW: programs (t, 1) store row t of win_ptr [T, WIN_DIM] in the window (v4_window.py);
    # INDEXER: programs (t, 1 + WINDOW) run the CSA indexer's compression (ix_*: its own projections,
    # cache layers, bias, norm and IX_ shape), of the same rate, overlap and rope
    wait_for_prior(PDL)
    compress_program(
        tl.program_id(0).to(tl.int64), tl.program_id(1), kv_ptr, gate_ptr, kv_cache_ptr, gate_cache_ptr, entry_ptr,
        entry_scale_ptr, ape_ptr, norm_ptr, cos_ptr, sin_ptr, positions_ptr, token_seq_ptr, window_slots_ptr,
        window_table_ptr, page_table_ptr, query_start_ptr, latent_ptr, eps, stride_kv, stride_gate, stride_kvc,
        stride_gc, stride_entry, stride_entry_scale, stride_ape, stride_cos, stride_pt, stride_latent, win_ptr,
        win_norm_ptr, win_cache_ptr, stride_win, stride_wc, win_eps, ix_kv_ptr, ix_gate_ptr, ix_kv_cache_ptr,
        ix_gate_cache_ptr, ix_entry_ptr, ix_entry_scale_ptr, ix_ape_ptr, ix_norm_ptr, ix_eps, stride_ix_kv,
        stride_ix_gate, stride_ix_kvc, stride_ix_gc, stride_ix_entry, stride_ix_entry_scale, stride_ix_ape,
        WIDTH, HEAD_DIM, ROPE_HALF, RATE, OVERLAP, NUM_SLOTS, PAGE_SIZE, ENTRIES_PER_PAGE, QUANTIZE, BLOCK_W, BLOCK_S,
        BLOCK_D, GATED, HAS_APE, LATENT, WINDOW, WIN_DIM, WIN_BLOCK, INDEXER, IX_WIDTH, IX_HEAD_DIM, IX_QUANTIZE,
        IX_BLOCK_W, IX_BLOCK_S, IX_BLOCK_D)


@triton.jit
def compress_program(
    t, role, kv_ptr, gate_ptr, kv_cache_ptr, gate_cache_ptr, entry_ptr, entry_scale_ptr, ape_ptr, norm_ptr, cos_ptr,
    sin_ptr, positions_ptr, token_seq_ptr, window_slots_ptr, window_table_ptr, page_table_ptr, query_start_ptr,
    latent_ptr, eps, stride_kv, stride_gate, stride_kvc, stride_gc, stride_entry, stride_entry_scale, stride_ape,
    stride_cos, stride_pt, stride_latent, win_ptr, win_norm_ptr, win_cache_ptr, stride_win, stride_wc, win_eps,
    ix_kv_ptr, ix_gate_ptr, ix_kv_cache_ptr, ix_gate_cache_ptr, ix_entry_ptr, ix_entry_scale_ptr, ix_ape_ptr,
    ix_norm_ptr, ix_eps, stride_ix_kv, stride_ix_gate, stride_ix_kvc, stride_ix_gc, stride_ix_entry,
    stride_ix_entry_scale, stride_ix_ape,
    WIDTH: tl.constexpr, HEAD_DIM: tl.constexpr, ROPE_HALF: tl.constexpr, RATE: tl.constexpr,
    OVERLAP: tl.constexpr, NUM_SLOTS: tl.constexpr, PAGE_SIZE: tl.constexpr, ENTRIES_PER_PAGE: tl.constexpr,
    QUANTIZE: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    GATED: tl.constexpr, HAS_APE: tl.constexpr, LATENT: tl.constexpr, WINDOW: tl.constexpr, WIN_DIM: tl.constexpr,
    WIN_BLOCK: tl.constexpr, INDEXER: tl.constexpr, IX_WIDTH: tl.constexpr, IX_HEAD_DIM: tl.constexpr,
    IX_QUANTIZE: tl.constexpr, IX_BLOCK_W: tl.constexpr, IX_BLOCK_S: tl.constexpr, IX_BLOCK_D: tl.constexpr,
):
    """Program (t, role) of ``compress_kernel``'s launch: token t's compression, its window row or its
    indexer's compression; what v4_compress_select.py's launch runs for each of them too."""
    if WINDOW and role == 1:  # a program of its own: the pooling's registers stay its own
        one = t + tl.arange(0, 1)
        window_rows(win_ptr, win_norm_ptr, win_cache_ptr, cos_ptr, sin_ptr, positions_ptr, window_slots_ptr, one,
                    one >= 0, stride_win, stride_wc, stride_cos, win_eps, WIN_DIM, ROPE_HALF, 1, WIN_BLOCK)
    elif INDEXER and role == 1 + WINDOW:
        _compress_token(t, ix_kv_ptr, ix_gate_ptr, ix_kv_cache_ptr, ix_gate_cache_ptr, ix_entry_ptr,
                        ix_entry_scale_ptr, ix_ape_ptr, ix_norm_ptr, cos_ptr, sin_ptr, positions_ptr, token_seq_ptr,
                        window_slots_ptr, window_table_ptr, page_table_ptr, query_start_ptr, latent_ptr, ix_eps,
                        stride_ix_kv, stride_ix_gate, stride_ix_kvc, stride_ix_gc, stride_ix_entry,
                        stride_ix_entry_scale, stride_ix_ape, stride_cos, stride_pt, stride_latent,
                        IX_WIDTH, IX_HEAD_DIM, ROPE_HALF, RATE, OVERLAP, NUM_SLOTS, PAGE_SIZE, ENTRIES_PER_PAGE,
                        IX_QUANTIZE, IX_BLOCK_W, IX_BLOCK_S, IX_BLOCK_D, GATED, HAS_APE, False)
    else:
        _compress_token(t, kv_ptr, gate_ptr, kv_cache_ptr, gate_cache_ptr, entry_ptr, entry_scale_ptr, ape_ptr,
                        norm_ptr, cos_ptr, sin_ptr, positions_ptr, token_seq_ptr, window_slots_ptr, window_table_ptr,
                        page_table_ptr, query_start_ptr, latent_ptr, eps, stride_kv, stride_gate, stride_kvc,
                        stride_gc, stride_entry, stride_entry_scale, stride_ape, stride_cos, stride_pt, stride_latent,
                        WIDTH, HEAD_DIM, ROPE_HALF, RATE, OVERLAP, NUM_SLOTS, PAGE_SIZE, ENTRIES_PER_PAGE, QUANTIZE,
                        BLOCK_W, BLOCK_S, BLOCK_D, GATED, HAS_APE, LATENT)


@triton.jit
def index_key_kernel(proj_ptr, norm_ptr, key_ptr, key_scale_ptr, cos_ptr, sin_ptr, positions_ptr, token_seq_ptr,
                     page_table_ptr, eps, stride_proj, stride_key, stride_key_scale, stride_cos, stride_pt,
                     HEAD_DIM: tl.constexpr, ROPE_HALF: tl.constexpr, RATE: tl.constexpr, PAGE_SIZE: tl.constexpr,
                     ENTRIES_PER_PAGE: tl.constexpr, QUANTIZE: tl.constexpr, BLOCK_D: tl.constexpr,
                     PDL: tl.constexpr):
    """CSA2's index keys: program t, if its position closes a window, takes row t of the projected
    latents, normalises it (fp32 weight, rounded once to its dtype) and keeps it as an entry is kept."""
    t = tl.program_id(0).to(tl.int64)
    wait_for_prior(PDL)
    p = tl.load(positions_ptr + t)
    if (p + 1) % RATE == 0:
        s = tl.load(token_seq_ptr + t).to(tl.int64)
        ch = tl.arange(0, BLOCK_D)
        ch_mask = ch < HEAD_DIM
        x = tl.load(proj_ptr + t * stride_proj + ch, mask=ch_mask, other=0.0)
        normed = _rms_normed(x.to(tl.float32), norm_ptr, ch, ch_mask, eps, x.dtype, HEAD_DIM)
        _keep(normed, p, page_table_ptr + s * stride_pt, key_ptr, key_scale_ptr, cos_ptr, sin_ptr, stride_key,
              stride_key_scale, stride_cos, ch, ch_mask, HEAD_DIM, ROPE_HALF, RATE, PAGE_SIZE, ENTRIES_PER_PAGE,
              QUANTIZE, BLOCK_D)


def tiles(head_dim: int, num_slots: int, cfg: CompressConfig) -> tuple[int, int, int]:
    """BLOCK_D, BLOCK_S and the warps of a launch."""
    block_d = triton.next_power_of_2(head_dim)
    block_s = min(triton.next_power_of_2(num_slots), max(1, cfg.tile_elements // block_d))
    return block_d, block_s, max(1, min(cfg.max_warps, block_s * block_d // cfg.elements_per_warp))


def _check(kv_proj: torch.Tensor, gate_proj: torch.Tensor | None, comp: Compression, layer: V4AttentionLayer,
           projections: tuple[torch.Tensor, torch.Tensor] | None, entries: torch.Tensor) -> None:
    head_dim, rate = comp.head_dim, comp.rate
    width = 2 * head_dim if comp.overlap else head_dim
    gated = projections is not None
    if kv_proj.dim() != 2 or kv_proj.shape[1] != width or (gated and (gate_proj is None or
                                                                      gate_proj.shape != kv_proj.shape)):
        raise ValueError(f"kv_proj {tuple(kv_proj.shape)} and gate_proj "
                         f"{None if gate_proj is None else tuple(gate_proj.shape)}: need [tokens, {width}] "
                         f"({'twice ' if comp.overlap else ''}the compression's head dim {head_dim})"
                         f"{'' if gated else ' and no gate'}")
    if not gated and (rate != 1 or comp.overlap or gate_proj is not None):
        raise ValueError(f"comp.projections is None: only a rate-1 compression without a gate keeps none (rate "
                         f"{rate}, overlap {comp.overlap}, gate_proj {gate_proj is not None})")
    if gated and (projections[0].shape[1] != width or projections[1].shape[1] != width):
        raise ValueError(f"comp.projections: cache layer {comp.projections} keeps k {projections[0].shape[1]} and "
                         f"v {projections[1].shape[1]} channels per token, need {width}")
    if entries.shape[1] != head_dim:
        raise ValueError(f"comp.entries: cache layer {comp.entries} keeps {entries.shape[1]} channels per entry, "
                         f"need {head_dim}")
    if rate < 1 or comp.ape is not None and (comp.ape.shape != (rate, width) or comp.ape.dtype != torch.float32):
        raise ValueError(f"comp.ape: {tuple(comp.ape.shape)} {comp.ape.dtype}, need [{rate}, {width}] float32")
    if comp.norm_weight.dtype != torch.float32 or head_dim % 2:
        raise ValueError(f"comp.norm_weight: {tuple(comp.norm_weight.shape)} {comp.norm_weight.dtype}, need an even "
                         f"head dim in float32")
    if not 0 < layer.rope.cos.shape[-1] * 2 <= head_dim:
        raise ValueError(f"layer.rope rotates {2 * layer.rope.cos.shape[-1]} channels, more than the entry's {head_dim}")
    key = comp.index_key
    if key is not None and (key.norm_weight.dtype != torch.float32 or key.norm_weight.shape[0] % 2 or
                            not 0 < layer.rope.cos.shape[-1] * 2 <= key.norm_weight.shape[0]):
        raise ValueError(f"comp.index_key.norm_weight: {tuple(key.norm_weight.shape)} {key.norm_weight.dtype}, need "
                         f"an even index head dim in float32, at least the rope's {2 * layer.rope.cos.shape[-1]}")


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Where the latents' scratch comes from (tests poison it)."""
    return torch.empty(shape, dtype=dtype, device=device)


@dataclass(frozen=True)
class _Pooling:
    """One compression's part of a launch: its tensors (kv and gate projections, their cache
    layers, entries, entry scales, ape, norm weight), eps, their row strides and its shape."""

    tensors: tuple[torch.Tensor, ...]
    eps: float
    strides: tuple[int, ...]
    shape: dict
    num_warps: int


def _pooling(kv_proj: torch.Tensor, gate_proj: torch.Tensor | None, comp: Compression,
             layer: V4AttentionLayer, kv: KVCache) -> _Pooling:
    gated = comp.projections is not None
    projections = flat(kv, comp.projections) if gated else None
    entries, scales = entries_of(kv, comp.entries)
    _check(kv_proj, gate_proj, comp, layer, projections, entries)
    kv_proj = _unit_last(kv_proj)
    gate_proj = _unit_last(gate_proj) if gated else kv_proj  # unread placeholders where there is no gate
    kv_cache, gate_cache = projections if gated else (entries, entries)
    ape = comp.ape if comp.ape is not None else comp.norm_weight
    quantize = scales is not None
    scales = scales if quantize else entries  # an unread placeholder where the entries are not E4M3
    num_slots = 2 * comp.rate if comp.overlap else comp.rate
    block_d, block_s, num_warps = tiles(comp.head_dim, num_slots, config_for(COMPRESS, kv_proj.device))
    return _Pooling((kv_proj, gate_proj, kv_cache, gate_cache, entries, scales, ape, comp.norm_weight), comp.eps,
                    tuple(x.stride(0) for x in (kv_proj, gate_proj, kv_cache, gate_cache, entries, scales, ape)),
                    dict(WIDTH=kv_proj.shape[1], HEAD_DIM=comp.head_dim, QUANTIZE=quantize,
                         BLOCK_W=triton.next_power_of_2(kv_proj.shape[1]), BLOCK_S=block_s, BLOCK_D=block_d),
                    num_warps)


def _indexer_pooling(indexer: tuple[torch.Tensor, torch.Tensor], comp: Compression, layer: V4AttentionLayer,
                     kv: KVCache) -> _Pooling:
    """The CSA indexer's compression beside ``comp``, the layer's: same rate, overlap and gating."""
    ix = layer.indexer.compression if layer.indexer is not None else None
    if ix is None or (ix.rate, ix.overlap, ix.projections is None, ix.ape is None, ix.index_key) != (
            comp.rate, comp.overlap, comp.projections is None, comp.ape is None, None):
        raise ValueError("indexer projections need layer.indexer.compression at the layer's compression's rate, "
                         "overlap, gate and position bias (a CSA layer's)")
    return _pooling(*indexer, ix, layer, kv)


@dataclass(frozen=True)
class CompressLaunch:
    """What ``compress_kernel`` takes for a step: its arguments, constexprs, programs per token (the
    grid's second dimension), warps, and the latents' scratch an indexing CSA2 source leaves."""

    args: tuple
    constexprs: dict
    roles: int
    num_warps: int
    latent: torch.Tensor | None


def compress_launch(kv_proj: torch.Tensor, gate_proj: torch.Tensor | None, comp: Compression,
                    layer: V4AttentionLayer, kv: KVCache, batch: ForwardBatch, meta,
                    window: torch.Tensor | None = None,
                    indexer: tuple[torch.Tensor, torch.Tensor] | None = None) -> CompressLaunch | None:
    """``compress``'s launch, checked (None for a step of no tokens)."""
    main = _pooling(kv_proj, gate_proj, comp, layer, kv)
    ix = None if indexer is None else _indexer_pooling(indexer, comp, layer, kv)
    tokens = kv_proj.shape[0]
    if indexer is not None and indexer[0].shape[0] != tokens:
        raise ValueError(f"the indexer's projections for {indexer[0].shape[0]} tokens beside projections of {tokens}")
    if tokens == 0:
        return None
    gated = comp.projections is not None
    cos, sin = layer.rope.cos, layer.rope.sin
    latent = None
    if comp.index_key is not None:  # the latent is in the dtype the entry is normalised in
        latent = _empty((tokens, comp.head_dim), main.tensors[2].dtype if gated else kv_proj.dtype, kv_proj.device)
    win_cache = None
    if window is not None:
        win_cache = flat(kv, layer.window_kv)[0]
        window = check_window(window, layer.kv_norm, win_cache)
        if window.shape[0] != tokens:
            raise ValueError(f"window KV for {window.shape[0]} tokens beside projections of {tokens}")
    rate = comp.rate
    args = (
        *main.tensors, cos, sin, batch.positions, meta.token_seq, meta.window_slots, meta.window_table,
        batch.page_table, batch.query_start_loc, kv_proj if latent is None else latent, main.eps, *main.strides,
        cos.stride(0), batch.page_table.stride(0), 0 if latent is None else latent.stride(0),
        kv_proj if window is None else window, comp.norm_weight if window is None else layer.kv_norm,
        kv_proj if window is None else win_cache, 0 if window is None else window.stride(0),
        0 if window is None else win_cache.stride(0), layer.eps,
        *(main if ix is None else ix).tensors, (main if ix is None else ix).eps,  # unread without the indexer
        *(main if ix is None else ix).strides)
    constexprs = dict(
        **main.shape, ROPE_HALF=cos.shape[-1], RATE=rate, OVERLAP=int(comp.overlap),
        NUM_SLOTS=2 * rate if comp.overlap else rate, PAGE_SIZE=batch.page_size,
        ENTRIES_PER_PAGE=-(-batch.page_size // rate), GATED=gated, HAS_APE=comp.ape is not None,
        LATENT=latent is not None, WINDOW=window is not None,
        WIN_DIM=1 if window is None else window.shape[1],
        WIN_BLOCK=1 if window is None else triton.next_power_of_2(window.shape[1]),
        INDEXER=ix is not None, **({} if ix is None else {f"IX_{k}": v for k, v in ix.shape.items()}))
    return CompressLaunch(args, constexprs, 1 + (window is not None) + (ix is not None),
                          max(main.num_warps, 1 if ix is None else ix.num_warps), latent)


def compress(kv_proj: torch.Tensor, gate_proj: torch.Tensor | None, comp: Compression, layer: V4AttentionLayer,
             kv: KVCache, batch: ForwardBatch, meta, window: torch.Tensor | None = None,
             indexer: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """``V4AttentionBackend.compress`` for the whole step: ``meta`` gives each token's sequence
    (``token_seq`` [T] int32), its window slot (``window_slots`` [T] int64) and the page -> window
    page table (``window_table``); nothing is read back to the host. A CSA2 KV source that indexes
    (``comp.index_key``) keeps its entries' index keys too: its projection runs on the latents the
    launch leaves, then ``index_key_kernel`` keeps them. ``window`` [T, head_dim]: the layer's window
    KV, stored in the same launch as ``V4AttentionBackend.store`` stores it. ``indexer``: the CSA
    indexer's (kv, gate) projections, compressed into ``layer.indexer.compression`` in the same
    launch (programs of their own)."""
    launch = compress_launch(kv_proj, gate_proj, comp, layer, kv, batch, meta, window, indexer)
    if launch is None:
        return
    compress_kernel[(kv_proj.shape[0], launch.roles)](
        *launch.args, **launch.constexprs, num_warps=launch.num_warps,
        enable_fp_fusion=False,  # a fused multiply-add skips a rounding step
        **launch_options(kv_proj.device),
    )
    if launch.latent is not None:
        keep_index_keys(comp.index_key.project(launch.latent), comp, layer, kv, batch, meta)


def keep_index_keys(projected: torch.Tensor, comp: Compression, layer: V4AttentionLayer, kv: KVCache,
                    batch: ForwardBatch, meta) -> None:
    """The index keys of the entries the step closes, from their projected latents [T, index_head_dim]
    (row t: the entry token t closes; other rows unread): RMSNorm by ``comp.index_key``, rotation at
    the window's first position, kept in ``comp.index_key.keys`` (E4M3 with a scale where it keeps E4M3)."""
    key = comp.index_key
    keys, scales = entries_of(kv, key.keys)
    tokens, dim = projected.shape
    if keys.shape[1] != dim or key.norm_weight.shape != (dim,):
        raise ValueError(f"comp.index_key: projected latents of {dim} channels, but cache layer {key.keys} keeps "
                         f"{keys.shape[1]} and the norm weighs {tuple(key.norm_weight.shape)}")
    projected = _unit_last(projected)
    cos, sin = layer.rope.cos, layer.rope.sin
    index_key_kernel[(tokens,)](
        projected, key.norm_weight, keys, keys if scales is None else scales, cos, sin, batch.positions,
        meta.token_seq, batch.page_table, key.eps, projected.stride(0), keys.stride(0),
        0 if scales is None else scales.stride(0), cos.stride(0), batch.page_table.stride(0),
        HEAD_DIM=dim, ROPE_HALF=cos.shape[-1], RATE=comp.rate, PAGE_SIZE=batch.page_size,
        ENTRIES_PER_PAGE=-(-batch.page_size // comp.rate), QUANTIZE=scales is not None,
        BLOCK_D=triton.next_power_of_2(dim), num_warps=1, enable_fp_fusion=False, **launch_options(projected.device),
    )
