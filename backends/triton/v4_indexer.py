"""DeepSeek-V4's lightning indexer for a whole step: scores over the paged index keys, then top-k.

Two kernels, in one launch (``index_topk_kernel``) or two, graph-safe (the grid comes from T and the
static ``max_entries``; every loop bound that depends on a sequence is read on the device):

1. ``index_scores_kernel``: a program takes one token and every head at once (heads are the MMA's
   M dimension: all of them share one key), rotates the query's rope tail at its position in
   registers (core/native/tail_rope.py's rounding), and walks blocks of the entries the token sees
   (N), reading each key from its page through the entry-slot formula of
   core/models/deepseek_v4/cache.py. Score = sum_h w_h * relu(q_h . k) * d^-0.5 in fp32, in the
   order core/native/indexer.py's ``index_scores`` applies them, into a [T, max_entries] scratch.
2. ``stable_topk_kernel``: a program per token selects among its visible scores only: a radix
   select over the scores as order-preserving int32 (four 8-bit digits) finds the top_k-th largest
   value, then one pass in entry order takes every larger score and, of the scores equal to it,
   the lowest entries. Exact and stable: among equal scores the lowest entry index wins.

Both take part in programmatic dependent launch (pdl.py), as the other decode-path kernels do.

``index_topk`` runs both in one launch: the scores' grid, each program then counting itself in at
its token's arrival counter (a barrier, then an acq_rel atomic at GPU scope, as the split decode
attention counts; the same counters, left at 0 by every launch); the last of a token's splits to
arrive sees the whole row and runs the top-k's program for it. The top-k so starts as soon as a
token's scores are in rather than after every token's and a launch, on the scoring's warps (both
4 in the tables); what it computes is the two launches' to the bit. The candidate filter keeps its
launches (``block_best_kernel`` runs between). In a CSA layer's decode step the same programs
(``index_topk_program``) run in its compressor's launch instead (v4_compress_select.py).

FP8 keys (E4M3, one fp32 scale per key, as DeepSeek stores them) are scored by the same kernel:
the key converts exactly to the query's dtype for the MMA, and its scale multiplies the dot.

DeepSeek-V4.1's candidate filter reuses both: a candidate source's scores go through
``block_best_kernel`` (each visible block's best score, the block of the newest entry +inf) and
``stable_topk_kernel`` over the blocks (``GROUP``), so the blocks are chosen as entries are, ties
to the lowest; an index source filtered by them scores only the entries of its candidate blocks
(``index_scores_kernel`` walks the blocks, ``NUM_CAND``) and ``stable_topk_kernel`` selects among
them, walking the blocks sorted ascending (so in entry order: ties to the lowest).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from engine.core.families.v4_attention import V4AttentionLayer
from engine.core.forward import ForwardBatch
from engine.core.kv.storage import KVCache
from engine.core.models.deepseek_v4.cache import entries_of

from .attention_decode import arrival_counters
from .pdl import launch_options, wait_for_prior
from .tail_rope import rotate_pairs, tail_cos_sin
from .target import config_for

SCRATCH_BYTES = 1 << 29  # the most the scores of one launch may take; longer steps run in token chunks


@dataclass(frozen=True)
class IndexerConfig:
    block_n: int  # entries per MMA
    num_warps: int
    programs: int  # programs to aim for: a short step splits each token's entries over several
    topk_block: int  # scores per step of the top-k's passes
    topk_warps: int


_HIP_INDEXER = IndexerConfig(block_n=64, num_warps=4, programs=1216, topk_block=1024, topk_warps=4)  # 4 a CU of 304
INDEXER = {
    "cuda": IndexerConfig(block_n=64, num_warps=4, programs=1056, topk_block=1024, topk_warps=4),
    "hip": _HIP_INDEXER,
    "gfx950": replace(_HIP_INDEXER, programs=4 * 256),  # MI355X has 256 CUs, MI300X/MI325X (gfx942) 304
    # the interpreter: several splits and several top-k blocks even at small shapes
    "default": IndexerConfig(block_n=16, num_warps=1, programs=8, topk_block=8, topk_warps=1),
}


@triton.jit
def index_scores_kernel(
    q_ptr, w_ptr, keys_ptr, scales_ptr, cos_ptr, sin_ptr, positions_ptr, token_seq_ptr, page_table_ptr, out_ptr,
    cand_ptr, max_entries, sm_scale, w_scale,
    stride_qt, stride_qh, stride_wt, stride_key, stride_cos, stride_pt, stride_out, stride_c,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, ROT_HALF: tl.constexpr, RATE: tl.constexpr,
    PAGE_SIZE: tl.constexpr, SPLITS: tl.constexpr, HAS_SCALES: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
    NUM_CAND: tl.constexpr = 0, CAND_SIZE: tl.constexpr = 1,
):
    # NUM_CAND > 0: only the entries of the row's NUM_CAND blocks of CAND_SIZE (cand_ptr, -1: none) are
    # scored, in the blocks' order; the rest of the row is left as it was
    wait_for_prior(PDL)
    _score_row(tl.program_id(0).to(tl.int64), tl.program_id(1), q_ptr, w_ptr, keys_ptr, scales_ptr, cos_ptr, sin_ptr,
               positions_ptr, token_seq_ptr, page_table_ptr, out_ptr, cand_ptr, max_entries, sm_scale, w_scale,
               stride_qt, stride_qh, stride_wt, stride_key, stride_cos, stride_pt, stride_out, stride_c, NUM_HEADS,
               HEAD_DIM, ROT_HALF, RATE, PAGE_SIZE, SPLITS, HAS_SCALES, DOT_FP32, BLOCK_H, BLOCK_N, BLOCK_D, NUM_CAND,
               CAND_SIZE)


@triton.jit
def _score_row(
    token, split, q_ptr, w_ptr, keys_ptr, scales_ptr, cos_ptr, sin_ptr, positions_ptr, token_seq_ptr, page_table_ptr,
    out_ptr, cand_ptr, max_entries, sm_scale, w_scale,
    stride_qt, stride_qh, stride_wt, stride_key, stride_cos, stride_pt, stride_out, stride_c,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, ROT_HALF: tl.constexpr, RATE: tl.constexpr,
    PAGE_SIZE: tl.constexpr, SPLITS: tl.constexpr, HAS_SCALES: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, NUM_CAND: tl.constexpr,
    CAND_SIZE: tl.constexpr,
):
    """Split ``split`` of token ``token``'s scores: its share of the entry blocks."""
    pos = tl.load(positions_ptr + token)
    seq = tl.load(token_seq_ptr + token).to(tl.int64)
    visible = tl.minimum((pos + 1) // RATE, max_entries)  # the bound keeps a bad position in its row
    heads = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    x = tl.load(q_ptr + token * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=(heads < NUM_HEADS)[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
    cos, sin = tail_cos_sin(cos_ptr, sin_ptr, pos, stride_cos, x.dtype, HEAD_DIM, ROT_HALF, BLOCK_D)
    q = rotate_pairs(x, cos[None, :], sin[None, :], BLOCK_H, BLOCK_D).to(x.dtype)  # rounded as rotate_tail
    if DOT_FP32:
        q = q.to(tl.float32)
    weights = tl.load(w_ptr + token * stride_wt + heads, mask=heads < NUM_HEADS, other=0.0).to(tl.float32) * w_scale
    table = page_table_ptr + seq * stride_pt
    slots_per_page: tl.constexpr = (PAGE_SIZE + RATE - 1) // RATE
    listed = tl.where(NUM_CAND > 0, NUM_CAND * CAND_SIZE, visible)  # the entries it walks
    for block in range(split, tl.cdiv(listed, BLOCK_N), SPLITS):
        w = block * BLOCK_N + tl.arange(0, BLOCK_N)
        if NUM_CAND > 0:
            cand = tl.load(cand_ptr + token * stride_c + w // CAND_SIZE, mask=w < listed, other=-1)
            w = cand * CAND_SIZE + w % CAND_SIZE
            seen = (cand >= 0) & (w < visible)
        else:
            seen = w < visible
        page_index = (w * RATE + RATE - 1) // PAGE_SIZE
        page = tl.load(table + page_index, mask=seen, other=0).to(tl.int64)
        slot = page * slots_per_page + w - page_index * PAGE_SIZE // RATE
        k = tl.load(keys_ptr + slot[:, None] * stride_key + d[None, :],
                    mask=seen[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
        if DOT_FP32:  # true fp32 products, not TF32
            dot = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")  # [BLOCK_H, BLOCK_N]
        else:
            dot = tl.dot(q, tl.trans(k.to(q.dtype)))
        if HAS_SCALES:
            dot = dot * tl.load(scales_ptr + slot, mask=seen, other=0.0)[None, :]
        per_head = tl.maximum(dot, 0.0) * sm_scale
        total = tl.sum(per_head * weights[:, None], axis=0)
        total = tl.where(total == 0.0, 0.0, total)  # -0.0 ties with 0.0
        tl.store(out_ptr + token * stride_out + w, total, mask=seen)


@triton.jit
def _ordered(row, idx, mask):
    """fp32 scores as int32 whose signed order is the floats' order (-0.0 was stored as 0.0)."""
    bits = tl.load(row + idx, mask=mask, other=0.0).to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _listed(start, lane, n, cand_row, NUM_CAND: tl.constexpr, CAND_SIZE: tl.constexpr):
    """Entries start + lane of the walk and which of them count: entries 0..n-1; with the candidate
    filter (NUM_CAND > 0) the entries of the row's blocks ``cand_row`` (ascending, -1: none) in order."""
    if NUM_CAND > 0:
        j = start + lane
        block = tl.load(cand_row + j // CAND_SIZE, mask=j < NUM_CAND * CAND_SIZE, other=-1)
        idx = block * CAND_SIZE + j % CAND_SIZE
        ok = (block >= 0) & (idx < n)
    else:
        idx = start + lane
        ok = idx < n
    return idx, ok


@triton.jit
def stable_topk_kernel(scores_ptr, positions_ptr, cand_ptr, out_ptr, max_entries, stride_s, stride_c, stride_o,
                       TOP_K: tl.constexpr, RATE: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
                       GROUP: tl.constexpr = 1, NUM_CAND: tl.constexpr = 0, CAND_SIZE: tl.constexpr = 1):
    # GROUP: a score per group of that many entries (the candidate source's blocks). NUM_CAND > 0: the
    # candidate filter; only entries in the row's NUM_CAND blocks of CAND_SIZE entries (cand_ptr,
    # ascending, -1 first) count, and only those are read
    wait_for_prior(PDL)
    _stable_topk_row(tl.program_id(0).to(tl.int64), scores_ptr, positions_ptr, cand_ptr, out_ptr, max_entries,
                     stride_s, stride_c, stride_o, TOP_K, RATE, BLOCK, GROUP, NUM_CAND, CAND_SIZE)


@triton.jit
def _stable_topk_row(token, scores_ptr, positions_ptr, cand_ptr, out_ptr, max_entries, stride_s, stride_c, stride_o,
                     TOP_K: tl.constexpr, RATE: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr,
                     NUM_CAND: tl.constexpr, CAND_SIZE: tl.constexpr):
    """Token ``token``'s top-k, written to its row of ``out_ptr``."""
    visible = tl.minimum((tl.load(positions_ptr + token) + 1) // RATE, max_entries).to(tl.int32)
    n = tl.cdiv(visible, GROUP)  # the scores it sees
    row = scores_ptr + token * stride_s
    cand_row = cand_ptr + token * stride_c
    out = out_ptr + token * stride_o
    lane = tl.arange(0, BLOCK)
    span = tl.where(NUM_CAND > 0, NUM_CAND * CAND_SIZE, n)  # the walk's length
    count = n
    if NUM_CAND > 0:  # the blocks are distinct: the entries they hold, as many as are seen
        count = 0
        for c0 in range(0, NUM_CAND, BLOCK):
            cands = tl.load(cand_row + c0 + lane, mask=c0 + lane < NUM_CAND, other=-1)
            count += tl.sum(tl.where(cands >= 0, tl.minimum(tl.maximum(n - cands * CAND_SIZE, 0), CAND_SIZE), 0), 0)
    if count <= TOP_K:  # every score that counts, in order, then -1
        taken = 0
        for start in range(0, span, BLOCK):
            idx, take = _listed(start, lane, n, cand_row, NUM_CAND, CAND_SIZE)
            take = take.to(tl.int32)
            tl.store(out + taken + tl.cumsum(take, 0) - take, idx, mask=take != 0)
            taken += tl.sum(take, 0)
        for first in range(0, TOP_K, BLOCK):
            idx = first + lane
            tl.store(out + idx, -1, mask=(idx >= count) & (idx < TOP_K))
    else:
        # the top_k-th largest value, 8 bits at a time from the top; ``wanted``: how many of the
        # values that share the digits found so far are still to be taken
        threshold = 0
        wanted = TOP_K
        bins = tl.arange(0, 256)
        for p in tl.static_range(4):
            shift = 24 - 8 * p
            hist = tl.zeros([256], tl.int32)
            for start in range(0, span, BLOCK):
                idx, mask = _listed(start, lane, n, cand_row, NUM_CAND, CAND_SIZE)
                key = _ordered(row, idx, mask)
                if p == 0:
                    digit = ((key >> 24) & 255) ^ 128  # the sign bit flipped: unsigned order
                else:
                    digit = (key >> shift) & 255
                    mask = mask & ((key >> (shift + 8)) == (threshold >> (shift + 8)))
                hist += tl.histogram(digit, 256, mask=mask)
            at_least = tl.cumsum(hist, 0, reverse=True)  # values with this digit or a larger one
            top = tl.max(tl.where(at_least >= wanted, bins, 0), 0)
            wanted -= tl.sum(tl.where(bins > top, hist, 0), 0)
            if p == 0:
                top = top ^ 128
            threshold = threshold | (top << shift)
        taken = 0
        equal_before = 0
        for start in range(0, span, BLOCK):
            idx, ok = _listed(start, lane, n, cand_row, NUM_CAND, CAND_SIZE)
            key = _ordered(row, idx, ok)
            equal = ((key == threshold) & ok).to(tl.int32)
            take = (((key > threshold) & ok) |
                    ((equal != 0) & (equal_before + tl.cumsum(equal, 0) - equal < wanted))).to(tl.int32)
            tl.store(out + taken + tl.cumsum(take, 0) - take, idx, mask=take != 0)
            taken += tl.sum(take, 0)
            equal_before += tl.sum(equal, 0)


@triton.jit
def block_best_kernel(scores_ptr, positions_ptr, out_ptr, max_entries, stride_s, stride_o,
                      RATE: tl.constexpr, SIZE: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_E: tl.constexpr,
                      PDL: tl.constexpr):
    """The candidate filter's first level: per block of SIZE entries a token sees, its best score; the
    block of its newest entry +inf (always a candidate)."""
    token = tl.program_id(0).to(tl.int64)
    wait_for_prior(PDL)
    visible = tl.minimum((tl.load(positions_ptr + token) + 1) // RATE, max_entries).to(tl.int32)
    n = tl.cdiv(visible, SIZE)
    e = tl.arange(0, BLOCK_E)
    for b0 in range(0, n, BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)
        idx = b[:, None] * SIZE + e[None, :]
        s = tl.load(scores_ptr + token * stride_s + idx, mask=(e < SIZE)[None, :] & (idx < visible),
                    other=float("-inf"))
        best = tl.where(b == n - 1, float("inf"), tl.max(s, 1))
        tl.store(out_ptr + token * stride_o + b, best, mask=b < n)


@triton.jit
def index_topk_kernel(
    q_ptr, w_ptr, keys_ptr, scales_ptr, cos_ptr, sin_ptr, positions_ptr, token_seq_ptr, page_table_ptr, out_ptr,
    cand_ptr, max_entries, sm_scale, w_scale,
    stride_qt, stride_qh, stride_wt, stride_key, stride_cos, stride_pt, stride_out, stride_c,
    picks_ptr, counters_ptr, stride_picks,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, ROT_HALF: tl.constexpr, RATE: tl.constexpr,
    PAGE_SIZE: tl.constexpr, SPLITS: tl.constexpr, HAS_SCALES: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
    TOP_K: tl.constexpr, TOPK_BLOCK: tl.constexpr, NUM_CAND: tl.constexpr = 0, CAND_SIZE: tl.constexpr = 1,
):
    """``index_scores_kernel``'s program (token, split), then the count at the token's counter: the
    last of its SPLITS programs to arrive sees every score of the row, sets the counter back to 0 and
    runs ``stable_topk_kernel``'s program for the token into ``picks_ptr``."""
    wait_for_prior(PDL)
    token = tl.program_id(0).to(tl.int64)
    index_topk_program(token, tl.program_id(1), counters_ptr + token, q_ptr, w_ptr, keys_ptr, scales_ptr, cos_ptr,
                       sin_ptr, positions_ptr, token_seq_ptr, page_table_ptr, out_ptr, cand_ptr, max_entries, sm_scale,
                       w_scale, stride_qt, stride_qh, stride_wt, stride_key, stride_cos, stride_pt, stride_out,
                       stride_c, picks_ptr, stride_picks, NUM_HEADS, HEAD_DIM, ROT_HALF, RATE, PAGE_SIZE, SPLITS,
                       HAS_SCALES, DOT_FP32, BLOCK_H, BLOCK_N, BLOCK_D, TOP_K, TOPK_BLOCK, NUM_CAND, CAND_SIZE)


@triton.jit
def index_topk_program(
    token, split, counter, q_ptr, w_ptr, keys_ptr, scales_ptr, cos_ptr, sin_ptr, positions_ptr, token_seq_ptr,
    page_table_ptr, out_ptr, cand_ptr, max_entries, sm_scale, w_scale,
    stride_qt, stride_qh, stride_wt, stride_key, stride_cos, stride_pt, stride_out, stride_c, picks_ptr, stride_picks,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, ROT_HALF: tl.constexpr, RATE: tl.constexpr,
    PAGE_SIZE: tl.constexpr, SPLITS: tl.constexpr, HAS_SCALES: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, TOP_K: tl.constexpr,
    TOPK_BLOCK: tl.constexpr, NUM_CAND: tl.constexpr, CAND_SIZE: tl.constexpr,
):
    """Split ``split`` of token ``token``'s scores, then its count at ``counter`` (zero at the start,
    left so): the last of the token's SPLITS to arrive runs the token's top-k. What
    ``index_topk_kernel`` and v4_compress_select.py's launch run for each (token, split)."""
    _score_row(token, split, q_ptr, w_ptr, keys_ptr, scales_ptr, cos_ptr, sin_ptr, positions_ptr, token_seq_ptr,
               page_table_ptr, out_ptr, cand_ptr, max_entries, sm_scale, w_scale, stride_qt, stride_qh, stride_wt,
               stride_key, stride_cos, stride_pt, stride_out, stride_c, NUM_HEADS, HEAD_DIM, ROT_HALF, RATE,
               PAGE_SIZE, SPLITS, HAS_SCALES, DOT_FP32, BLOCK_H, BLOCK_N, BLOCK_D, NUM_CAND, CAND_SIZE)
    tl.debug_barrier()  # every thread's scores stored before the release
    if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == SPLITS - 1:
        tl.store(counter, 0)
        _stable_topk_row(token, out_ptr, positions_ptr, cand_ptr, picks_ptr, max_entries, stride_out, stride_c,
                         stride_picks, TOP_K, RATE, TOPK_BLOCK, 1, NUM_CAND, CAND_SIZE)


def output_buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Where the kernels' outputs come from (tests poison them)."""
    return torch.empty(shape, dtype=dtype, device=device)


def check_scoring(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, key_scales: torch.Tensor | None,
                  cos: torch.Tensor) -> None:
    tokens, num_heads, head_dim = q.shape
    if weights.shape != (tokens, num_heads):
        raise ValueError(f"weights {tuple(weights.shape)} must be [tokens, heads] = [{tokens}, {num_heads}]")
    if keys.dim() != 2 or keys.shape[1] != head_dim or keys.stride(1) != 1:
        raise ValueError(f"keys {tuple(keys.shape)} must be [slots, {head_dim}] with unit stride along the head dim")
    fp8 = keys.dtype == torch.float8_e4m3fn
    if fp8 != (key_scales is not None):
        raise ValueError(f"key_scales go with E4M3 keys and only with them (keys are {keys.dtype})")
    if fp8 and (key_scales.shape != keys.shape[:1] or key_scales.dtype != torch.float32):
        raise ValueError(f"key_scales {tuple(key_scales.shape)} {key_scales.dtype} must be fp32 [{keys.shape[0]}]")
    if 2 * cos.shape[-1] > head_dim:
        raise ValueError(f"rope dim {2 * cos.shape[-1]} exceeds the indexer head dim {head_dim}")


def _scored(q: torch.Tensor, weights: torch.Tensor, weight_scale: float, keys: torch.Tensor,
            key_scales: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
            token_seq: torch.Tensor, page_table: torch.Tensor, page_size: int, rate: int, max_entries: int,
            cfg: IndexerConfig):
    """(a, b, scores [b - a, max_entries]) for chunks a..b of the step's tokens, each chunk's scores
    launched just before it is yielded."""
    for a, b, scores, args, constexprs in scoring_chunks(q, weights, weight_scale, keys, key_scales, cos, sin,
                                                         positions, token_seq, page_table, page_size, rate,
                                                         max_entries, cfg):
        index_scores_kernel[(b - a, constexprs["SPLITS"])](**args, **constexprs, num_warps=cfg.num_warps,
                                                            enable_fp_fusion=False, **launch_options(q.device))
        yield a, b, scores


def scoring_chunks(q: torch.Tensor, weights: torch.Tensor, weight_scale: float, keys: torch.Tensor,
                   key_scales: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                   token_seq: torch.Tensor, page_table: torch.Tensor, page_size: int, rate: int, max_entries: int,
                   cfg: IndexerConfig, candidates: torch.Tensor | None = None, block_size: int = 1):
    """(a, b, scores [b - a, max_entries], arguments, constexprs) for chunks a..b of the step's tokens:
    what ``index_scores_kernel`` takes, by name, to score the chunk (grid: b - a tokens x SPLITS), the kernel
    taking the weights in their own dtype and scaling them in fp32 (as ``weights.float() *
    weight_scale``); with ``candidates`` [T, B] only the entries of those blocks of ``block_size``
    are scored (the rest of a row is unwritten). A fused multiply-add would skip the rotation's
    roundings: launch with ``enable_fp_fusion=False``."""
    tokens, num_heads, head_dim = q.shape
    q = q if q.stride(-1) == 1 else q.contiguous()
    weights = weights if weights.stride(-1) == 1 else weights.contiguous()
    fp8 = key_scales is not None
    exact = fp8 or keys.dtype == q.dtype  # an E4M3 key converts exactly to fp32, fp16 and bf16
    num_cand = 0 if candidates is None else candidates.shape[1]
    listed = max_entries if candidates is None else min(max_entries, num_cand * block_size)
    blocks = max(1, triton.cdiv(listed, cfg.block_n))
    step = max(1, SCRATCH_BYTES // (4 * max(1, max_entries)))
    for a in range(0, tokens, step):
        b = min(a + step, tokens)
        scores = output_buffer((b - a, max_entries), torch.float32, q.device)
        args = dict(q_ptr=q[a:b], w_ptr=weights[a:b], keys_ptr=keys, scales_ptr=key_scales if fp8 else keys,
                    cos_ptr=cos, sin_ptr=sin, positions_ptr=positions[a:b], token_seq_ptr=token_seq[a:b],
                    page_table_ptr=page_table, out_ptr=scores,
                    cand_ptr=token_seq if candidates is None else candidates[a:b], max_entries=max_entries,
                    sm_scale=head_dim ** -0.5, w_scale=weight_scale, stride_qt=q.stride(0), stride_qh=q.stride(1),
                    stride_wt=weights.stride(0), stride_key=keys.stride(0), stride_cos=cos.stride(0),
                    stride_pt=page_table.stride(0), stride_out=scores.stride(0),
                    stride_c=0 if candidates is None else candidates.stride(0))
        constexprs = dict(NUM_HEADS=num_heads, HEAD_DIM=head_dim, ROT_HALF=cos.shape[-1], RATE=rate,
                          PAGE_SIZE=page_size, SPLITS=max(1, min(blocks, cfg.programs // (b - a))), HAS_SCALES=fp8,
                          DOT_FP32=not exact or q.dtype == torch.float32,
                          BLOCK_H=max(16, triton.next_power_of_2(num_heads)), BLOCK_N=cfg.block_n,
                          BLOCK_D=triton.next_power_of_2(head_dim), NUM_CAND=num_cand, CAND_SIZE=block_size)
        yield a, b, scores, args, constexprs


def index_topk(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, key_scales: torch.Tensor | None,
               cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, token_seq: torch.Tensor,
               page_table: torch.Tensor, page_size: int, rate: int, top_k: int, max_entries: int,
               candidates: torch.Tensor | None = None, block_size: int = 0, weight_scale: float = 1.0) -> torch.Tensor:
    """q [T, H, d] (unrotated), weights [T, H] -> int32 [T, top_k]: each token's best visible
    entries by score, ties to the lowest index, -1 past the entries it sees; order within a row
    unspecified. The weights count as ``weights.float() * weight_scale``.

    ``keys`` [slots, d]: entry w of the sequence with page-table row r lies in the page of its
    window's last token, i = (w*rate + rate - 1) // page_size, at slot
    ``r[i] * ceil(page_size / rate) + w - i * page_size // rate`` (SeqView.entry_slots);
    ``key_scales`` [slots] fp32 with E4M3 keys (None otherwise). ``cos``/``sin`` [max_pos, rope/2]
    rotate the query's last ``rope`` channels. ``token_seq`` [T]: each token's page-table row.
    ``max_entries``: the most entries a sequence can have (a static bound: it sizes the grid).
    ``candidates`` [T, B] int32 (-1: none): only the entries of those blocks of ``block_size`` count.
    """
    check_scoring(q, weights, keys, key_scales, cos)
    tokens = q.shape[0]
    if candidates is not None and (candidates.dim() != 2 or candidates.shape[0] != tokens or block_size < 1):
        raise ValueError(f"candidates {tuple(candidates.shape)} must be [tokens={tokens}, blocks] of blocks of "
                         f"block_size {block_size} >= 1 entries")
    picks = output_buffer((tokens, top_k), torch.int32, q.device)
    cfg = config_for(INDEXER, q.device)
    # the blocks ascending (-1 first): the top-k walks their entries in entry order, ties to the lowest
    cands = None if candidates is None else candidates.sort(dim=1).values
    for a, b, _, args, constexprs in scoring_chunks(q, weights, weight_scale, keys, key_scales, cos, sin, positions,
                                                    token_seq, page_table, page_size, rate, max_entries, cfg, cands,
                                                    max(1, block_size)):
        index_topk_kernel[(b - a, constexprs["SPLITS"])](
            **args, picks_ptr=picks[a:b], counters_ptr=arrival_counters(b - a, q.device), stride_picks=picks.stride(0),
            **constexprs, TOP_K=top_k,
            TOPK_BLOCK=cfg.topk_block, num_warps=cfg.num_warps, enable_fp_fusion=False, **launch_options(q.device))
    return picks


def candidate_topk(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, key_scales: torch.Tensor | None,
                   cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, token_seq: torch.Tensor,
                   page_table: torch.Tensor, page_size: int, rate: int, num_blocks: int, block_size: int,
                   max_entries: int, weight_scale: float = 1.0) -> torch.Tensor:
    """DeepSeek-V4.1's candidate filter over the same scores as ``index_topk`` -> int32 [T, num_blocks]:
    the blocks of ``block_size`` entries whose best visible score is highest, the block of each
    token's newest visible entry always taken, ties to the lowest block, -1 where fewer blocks hold
    a visible entry; order within a row unspecified."""
    check_scoring(q, weights, keys, key_scales, cos)
    tokens = q.shape[0]
    chosen = output_buffer((tokens, num_blocks), torch.int32, q.device)
    cfg = config_for(INDEXER, q.device)
    max_blocks = -(-max_entries // block_size)
    block_e = triton.next_power_of_2(block_size)
    for a, b, scores in _scored(q, weights, weight_scale, keys, key_scales, cos, sin, positions, token_seq,
                                page_table, page_size, rate, max_entries, cfg):
        best = output_buffer((b - a, max_blocks), torch.float32, q.device)
        block_best_kernel[(b - a,)](scores, positions[a:b], best, max_entries, scores.stride(0), best.stride(0),
                                    RATE=rate, SIZE=block_size, BLOCK_B=max(1, cfg.topk_block // block_e),
                                    BLOCK_E=block_e, num_warps=cfg.topk_warps, **launch_options(q.device))
        stable_topk_kernel[(b - a,)](best, positions[a:b], chosen[a:b], chosen[a:b], max_entries, best.stride(0),
                                     chosen.stride(0), chosen.stride(0),
                                     TOP_K=num_blocks, RATE=rate, BLOCK=cfg.topk_block, GROUP=block_size,
                                     num_warps=cfg.topk_warps, **launch_options(q.device))
    return chosen


def index_keys(layer: V4AttentionLayer, q: torch.Tensor, kv: KVCache) -> tuple[torch.Tensor, torch.Tensor | None]:
    indexer = layer.indexer
    if q.shape[1:] != (indexer.num_heads, indexer.head_dim):
        raise ValueError(f"q {tuple(q.shape)} must be [tokens, {indexer.num_heads}, {indexer.head_dim}] "
                         f"(the indexer's heads and head dim)")
    return entries_of(kv, indexer.compression.entries)


def select(q: torch.Tensor, weights: torch.Tensor, layer: V4AttentionLayer, kv: KVCache, batch: ForwardBatch,
           meta, candidates: torch.Tensor | None = None) -> torch.Tensor:
    """``V4AttentionBackend.select`` for the whole step: the index keys as the cache keeps them
    (``layer.indexer.compression.entries``: the model's dtype, or E4M3 with their scales; a CSA2
    index source's: those its KV source derives), the rotation of ``layer.rope``; ``candidates``
    (the candidate source's blocks) narrow each row to their entries."""
    indexer = layer.indexer
    keys, scales = index_keys(layer, q, kv)
    return index_topk(q, weights, keys, scales, layer.rope.cos, layer.rope.sin, batch.positions, meta.token_seq,
                      batch.page_table, batch.page_size, indexer.compression.rate, indexer.top_k, meta.max_entries,
                      candidates, indexer.candidate_block_size, indexer.num_heads ** -0.5)


def select_candidates(q: torch.Tensor, weights: torch.Tensor, layer: V4AttentionLayer, kv: KVCache,
                      batch: ForwardBatch, meta) -> torch.Tensor:
    """``V4AttentionBackend.select_candidates`` for the whole step (a CSA2 candidate source)."""
    indexer = layer.indexer
    keys, scales = index_keys(layer, q, kv)
    return candidate_topk(q, weights, keys, scales, layer.rope.cos, layer.rope.sin, batch.positions, meta.token_seq,
                          batch.page_table, batch.page_size, indexer.compression.rate, indexer.candidate_blocks,
                          indexer.candidate_block_size, meta.max_entries, indexer.num_heads ** -0.5)
