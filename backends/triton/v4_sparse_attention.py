"""DeepSeek-V4's attention over a whole step: each query against its window and its entries.

A V4 layer has one K=V head shared by every query head, so a program takes one token and a block
of its heads (the MMA's M dimension) and reads each key once for all of them: the window keys
(positions max(0, p - window + 1) .. p, through the page table into the window pages), then the
compressed entries (HCA: every visible one, 0 .. (p + 1) // rate - 1; CSA: the indexer's
``picks``, -1 = none), in blocks of ``BLOCK_N`` with an online softmax in fp32. The sinks join
the denominator at the end. q is RMS-normalised per head and its rope tail turned on load, the
output's tail turned back, each rounded to q's dtype as core/native/v4_attention.py does. Where the
backend emits MXFP8 the epilogue then quantizes that output (E4M3, one E8M0 exponent per 32
channels, backends/triton/mxfp8.py's arithmetic), so the output projection reads 8.25 bits a value
and no separate quantization runs.

Few tokens (decode) leave most of the chip idle, so each token's keys (window then entries, as
one list) are cut into ``num_splits`` ranges of whole key blocks, one program each; the program
that arrives last at its (token, head block) counter combines the partial outputs with the sinks,
as backends/triton/attention_decode.py does (and with its counters). The number of splits
depends on the token count and static bounds only, and every range is read from the device
(positions, page table, picks), so a captured graph's launch holds across replays.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from engine.core.families.linear import MX_BLOCK, MXFP8Tensor
from engine.core.families.v4_attention import V4AttentionLayer
from engine.core.forward import ForwardBatch
from engine.core.kv.storage import KVCache
from engine.core.models.deepseek_v4.cache import flat

from .attention_decode import arrival_counters
from .attention_prefill import LOG2E
from .mxfp8 import mxfp8_blocks
from .pdl import launch_options, wait_for_prior
from .tail_rope import rotate_pairs, tail_cos_sin
from .target import config_for

# the entries a query reads: none, every visible one (HCA), the picks (CSA)
SLIDING, DENSE, PICKED = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
MX = tl.constexpr(MX_BLOCK)
FP8 = torch.float8_e4m3fn


@dataclass(frozen=True)
class SparseConfig:
    block_h: int  # query heads per program (16 or more: the smallest tl.dot)
    block_n: int  # keys per inner step
    num_warps: int
    num_stages: int
    # with the MXFP8 epilogue: its quantize holds the head block's fp32 output, which at head dim
    # 512 spills on sm_90 and sm_100 at 4 warps (29 local loads and stores, 80 with the combine) and
    # none at 8 (tests/backends/triton read the SASS); None: num_warps
    mxfp8_num_warps: int | None = None


@dataclass(frozen=True)
class SparseTuning:
    per_dim: dict  # head dim -> SparseConfig ("any": every head dim, the interpreter's)
    min_programs: int  # split while the grid stays within this many programs (a few per SM/CU)
    max_splits: int


C = SparseConfig
_HIP_SPARSE = SparseTuning({64: C(16, 64, 4, 1), 512: C(16, 32, 4, 1)}, min_programs=304 * 2, max_splits=32)
SPARSE = {  # guessed from backends/triton/attention_decode.py's measured table; not tuned on this kernel
    "cuda": SparseTuning({64: C(16, 64, 4, 2), 512: C(16, 32, 4, 2, mxfp8_num_warps=8)}, min_programs=132 * 4,
                         max_splits=32),
    "hip": _HIP_SPARSE,  # 2 programs a CU of MI300X/MI325X's (gfx942) 304; 4 waves keep the MXFP8 epilogue unspilled
    "gfx950": replace(_HIP_SPARSE, min_programs=256 * 2),  # MI355X has 256 CUs
    "default": SparseTuning({"any": C(16, 16, 4, 1)}, min_programs=16, max_splits=4),
}


@triton.jit
def _attend_keys(q, keys_ptr, slot, ok, m_i, l_i, acc, stride_k, qk_scale,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """One block of keys (K = V, rows ``slot`` where ``ok``) into the running softmax."""
    d = tl.arange(0, BLOCK_D)
    k = tl.load(keys_ptr + slot[:, None] * stride_k + d[None, :], mask=ok[:, None] & (d[None, :] < HEAD_DIM),
                other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
    s = tl.where(ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(k.dtype), k, input_precision="ieee")
    return m_new, l_i, acc


@triton.jit
def _entry_slots(pages_row, w, ok, PAGE_SIZE: tl.constexpr, RATE: tl.constexpr, ENTRIES_PER_PAGE: tl.constexpr):
    """Flat slots of entries ``w``: each in the page of its window's last token (SeqView.entry_slots)."""
    idx = (w * RATE + RATE - 1) // PAGE_SIZE
    page = tl.load(pages_row + idx, mask=ok, other=0).to(tl.int64)
    return page * ENTRIES_PER_PAGE + w - idx * PAGE_SIZE // RATE


@triton.jit
def _finish(out_ptr, out_scale_ptr, sinks_ptr, tok, head, h_ok, acc, m_i, l_i, cos, sin, stride_ot, stride_oh,
            stride_st, stride_sh, DTYPE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
            BLOCK_D: tl.constexpr, MXFP8: tl.constexpr):
    """The output of heads ``head`` from every key's ``acc`` (unnormalised, max ``m_i``, sum ``l_i``):
    the sinks join the denominator, then rounded to q's dtype and turned back, rounded again; with
    ``MXFP8`` then quantized as backends/triton/mxfp8.py does, E4M3 with one exponent per 32."""
    sink = tl.load(sinks_ptr + head, mask=h_ok, other=0.0) * LOG2E
    m = tl.maximum(m_i, sink)
    rescale = tl.exp2(m_i - m)
    l_i = l_i * rescale + tl.exp2(sink - m)
    o = (acc * rescale[:, None] / l_i[:, None]).to(DTYPE)
    o = rotate_pairs(o, cos[None, :], -sin[None, :], BLOCK_H, BLOCK_D).to(DTYPE)
    d = tl.arange(0, BLOCK_D)
    if MXFP8:  # channels past HEAD_DIM are zero: whole blocks of them, never stored
        data, exponent = mxfp8_blocks(tl.reshape(o.to(tl.float32), [BLOCK_H, BLOCK_D // MX, MX]))
        o = tl.reshape(data, [BLOCK_H, BLOCK_D])
        b = tl.arange(0, BLOCK_D // MX)
        tl.store(out_scale_ptr + tok * stride_st + head[:, None] * stride_sh + b[None, :], exponent.to(tl.uint8),
                 mask=h_ok[:, None] & (b[None, :] * MX < HEAD_DIM))
    tl.store(out_ptr + tok * stride_ot + head[:, None] * stride_oh + d[None, :], o,
             mask=h_ok[:, None] & (d[None, :] < HEAD_DIM))


@triton.jit
def _combine(part_out_ptr, part_lse_ptr, first, used, out_ptr, out_scale_ptr, sinks_ptr, tok, head, h_ok, cos,
             sin, stride_ot, stride_oh, stride_st, stride_sh, NUM_SPLITS: tl.constexpr, DTYPE: tl.constexpr,
             HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, MXFP8: tl.constexpr):
    """The output of heads ``head`` from the partials of the token's first ``used`` splits."""
    d = tl.arange(0, BLOCK_D)
    row = first + head * NUM_SPLITS
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    for s in range(used):
        m_i = tl.maximum(m_i, tl.load(part_lse_ptr + row + s, mask=h_ok, other=0.0))
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for s in range(used):
        w = tl.exp2(tl.load(part_lse_ptr + row + s, mask=h_ok, other=0.0) - m_i)
        part = tl.load(part_out_ptr + (row + s)[:, None] * HEAD_DIM + d[None, :],
                       mask=h_ok[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
        l_i += w
        acc += w[:, None] * part
    _finish(out_ptr, out_scale_ptr, sinks_ptr, tok, head, h_ok, acc, m_i, l_i, cos, sin, stride_ot, stride_oh,
            stride_st, stride_sh, DTYPE, HEAD_DIM, BLOCK_H, BLOCK_D, MXFP8)


@triton.jit
def sparse_attention_kernel(
    q_ptr, out_ptr, out_scale_ptr, window_ptr, entries_ptr, picks_ptr, sinks_ptr, cos_ptr, sin_ptr,
    positions_ptr, token_seq_ptr, page_table_ptr, window_table_ptr, part_out_ptr, part_lse_ptr, counters_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_st, stride_sh, stride_w, stride_e, stride_pick, stride_pt,
    stride_cos, qk_scale, window, eps,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, ROT_HALF: tl.constexpr, PAGE_SIZE: tl.constexpr,
    MODE: tl.constexpr, RATE: tl.constexpr, ENTRIES_PER_PAGE: tl.constexpr, TOP_K: tl.constexpr,
    NUM_SPLITS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    MXFP8: tl.constexpr, PDL: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    split = tl.program_id(2)
    wait_for_prior(PDL)
    pos = tl.load(positions_ptr + tok)
    # the token's keys as one list: its window (positions lo..pos), then its entries
    lo = tl.maximum(pos - window + 1, 0)
    n_window = pos + 1 - lo
    if MODE == DENSE:
        n_keys = n_window + (pos + 1) // RATE
    elif MODE == PICKED:
        n_keys = n_window + TOP_K
    else:
        n_keys = n_window
    per_split = tl.cdiv(tl.cdiv(n_keys, NUM_SPLITS), BLOCK_N) * BLOCK_N
    used = tl.cdiv(n_keys, per_split)
    if split < used:  # a short list fills the first splits only; the others have nothing to do
        head = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        h_ok = head < NUM_HEADS
        d = tl.arange(0, BLOCK_D)
        pages_row = page_table_ptr + tl.load(token_seq_ptr + tok).to(tl.int64) * stride_pt
        q = tl.load(q_ptr + tok * stride_qt + head[:, None] * stride_qh + d[None, :],
                    mask=h_ok[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
        # each head's unweighted RMSNorm: the reciprocal root rounded to q's dtype, then one exact
        # product in fp32 rounded once, as q's dtype multiplies in core/native/norm.py
        h = q.to(tl.float32)
        scale = tl.rsqrt(tl.sum(h * h, axis=1) / HEAD_DIM + eps).to(q.dtype).to(tl.float32)
        q = (h * scale[:, None]).to(q.dtype)
        cos, sin = tail_cos_sin(cos_ptr, sin_ptr, pos, stride_cos, q.dtype, HEAD_DIM, ROT_HALF, BLOCK_D)
        q = rotate_pairs(q, cos[None, :], sin[None, :], BLOCK_H, BLOCK_D).to(q.dtype)

        start = split * per_split
        end = tl.minimum(start + per_split, n_keys)
        m_i = tl.full([BLOCK_H], -1.0e30, tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        window_end = tl.minimum(end, n_window)
        for i0 in range(start, window_end, BLOCK_N):  # window keys, through the window pages
            i = i0 + tl.arange(0, BLOCK_N)
            ok = i < window_end
            n = lo + i
            page = tl.load(pages_row + n // PAGE_SIZE, mask=ok, other=0)
            slot = tl.load(window_table_ptr + page, mask=ok, other=0).to(tl.int64) * PAGE_SIZE + n % PAGE_SIZE
            m_i, l_i, acc = _attend_keys(q, window_ptr, slot, ok, m_i, l_i, acc, stride_w, qk_scale, HEAD_DIM,
                                         BLOCK_D)
        if MODE != SLIDING:
            entries_end = end - n_window
            for j0 in range(tl.maximum(start - n_window, 0), entries_end, BLOCK_N):
                j = j0 + tl.arange(0, BLOCK_N)
                if MODE == PICKED:
                    w = tl.load(picks_ptr + tok * stride_pick + j, mask=j < entries_end, other=-1)
                    ok = w >= 0
                else:
                    w = j
                    ok = j < entries_end
                slot = _entry_slots(pages_row, w, ok, PAGE_SIZE, RATE, ENTRIES_PER_PAGE)
                m_i, l_i, acc = _attend_keys(q, entries_ptr, slot, ok, m_i, l_i, acc, stride_e, qk_scale, HEAD_DIM,
                                             BLOCK_D)

        if NUM_SPLITS == 1 or used == 1:  # this program saw every key
            _finish(out_ptr, out_scale_ptr, sinks_ptr, tok, head, h_ok, acc, m_i, l_i, cos, sin, stride_ot,
                    stride_oh, stride_st, stride_sh, q.dtype, HEAD_DIM, BLOCK_H, BLOCK_D, MXFP8)
        else:
            # a split of picks may hold none (all -1): it weighs nothing in the combine
            seen = l_i > 0
            part = (tok * NUM_HEADS + head) * NUM_SPLITS + split
            tl.store(part_lse_ptr + part, tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf")),
                     mask=h_ok)
            tl.store(part_out_ptr + part[:, None] * HEAD_DIM + d[None, :], acc / tl.where(seen, l_i, 1.0)[:, None],
                     mask=h_ok[:, None] & (d[None, :] < HEAD_DIM))
            # as in attention_decode: the barrier orders every thread's partials before the one
            # thread's release; the last program to arrive acquires them all, combines, and leaves
            # the counter at 0 for the next launch
            tl.debug_barrier()
            counter = counters_ptr + tok * tl.num_programs(1) + tl.program_id(1)
            if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == used - 1:
                _combine(part_out_ptr, part_lse_ptr, tok * NUM_HEADS * NUM_SPLITS, used, out_ptr, out_scale_ptr,
                         sinks_ptr, tok, head, h_ok, cos, sin, stride_ot, stride_oh, stride_st, stride_sh, NUM_SPLITS,
                         q.dtype, HEAD_DIM, BLOCK_H, BLOCK_D, MXFP8)
                tl.store(counter, 0)


def kernel_config(head_dim: int, device: torch.device) -> tuple[SparseConfig, SparseTuning]:
    tuning = config_for(SPARSE, device)
    cfg = tuning.per_dim.get(head_dim) or tuning.per_dim.get("any")
    if cfg is None:
        raise ValueError(f"V4 sparse attention has no kernel config for head dim {head_dim}; "
                         f"configured: {sorted(tuning.per_dim)}")
    return cfg, tuning


def sparse_attention(q: torch.Tensor, layer: V4AttentionLayer, kv: KVCache, batch: ForwardBatch, meta,
                     picks: torch.Tensor | None = None, mxfp8: bool = False) -> torch.Tensor | MXFP8Tensor:
    """q [T, H, D] (raw: not normalised, unrotated) -> [T, H, D] in q's dtype: the family's ``attend`` (see
    core/families/v4_attention.py) for the whole step; with ``mxfp8`` that output quantized to MXFP8
    in the epilogue (one exponent per 32 channels of a head), as the grouped output projection reads it."""
    tokens, num_heads, head_dim = q.shape
    if (num_heads, head_dim) != (layer.num_heads, layer.head_dim):
        raise ValueError(f"q {tuple(q.shape)} does not fit the layer's {layer.num_heads} heads of {layer.head_dim}")
    comp = layer.compression
    # a CSA2 layer without an indexer of its own attends to its index source's picks ("Reuse")
    mode = SLIDING if comp is None else PICKED if layer.indexer is not None or picks is not None else DENSE
    if mode == PICKED and (picks is None or picks.dim() != 2 or picks.shape[0] != tokens):
        raise ValueError(f"a CSA layer needs picks [T={tokens}, top_k], got "
                         f"{None if picks is None else tuple(picks.shape)}")
    window_kv = flat(kv, layer.window_kv)[0]
    if window_kv.dtype != q.dtype:
        raise ValueError(f"q is {q.dtype} but the window KV is {window_kv.dtype}; the kernel reads them as one dtype")
    if mxfp8 and head_dim % MX_BLOCK:
        raise ValueError(f"MXFP8 output needs a head dim that is a multiple of {MX_BLOCK}, not {head_dim}")
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = torch.empty_like(q, dtype=FP8 if mxfp8 else q.dtype)
    out_scale = torch.empty(tokens, num_heads, head_dim // MX_BLOCK, dtype=torch.uint8, device=q.device) \
        if mxfp8 else None
    result = MXFP8Tensor(out, out_scale, q.dtype) if mxfp8 else out
    if tokens == 0:
        return result
    entries = flat(kv, comp.entries)[0] if comp is not None else window_kv
    picks = picks if mode == PICKED else batch.positions  # an unread placeholder
    rate = comp.rate if comp is not None else 1
    top_k = picks.shape[1] if mode == PICKED else 1
    cfg, tuning = kernel_config(head_dim, q.device)
    block_h = max(16, min(cfg.block_h, triton.next_power_of_2(num_heads)))
    head_blocks = triton.cdiv(num_heads, block_h)
    # the most keys a token has: its window and every entry the page table reaches (or the picks)
    reach = batch.page_table.shape[1] * batch.page_size
    most_keys = layer.window + {SLIDING.value: 0, DENSE.value: reach // rate, PICKED.value: top_k}[mode.value]
    splits = max(1, min(tuning.max_splits, tuning.min_programs // (tokens * head_blocks),
                        triton.cdiv(most_keys, cfg.block_n)))
    part_out = part_lse = counters = None  # one split writes the output itself
    if splits > 1:
        part_out = torch.empty(tokens, num_heads, splits, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(tokens, num_heads, splits, dtype=torch.float32, device=q.device)
        counters = arrival_counters(tokens * head_blocks, q.device)
    sparse_attention_kernel[(tokens, head_blocks, splits)](
        q, out, out_scale, window_kv, entries, picks, layer.sinks, layer.rope.cos, layer.rope.sin,
        batch.positions, meta.token_seq, batch.page_table, meta.window_table, part_out, part_lse, counters,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), *(out_scale.stride()[:2] if mxfp8 else (0, 0)),
        window_kv.stride(0), entries.stride(0),
        picks.stride(0), batch.page_table.stride(0), layer.rope.cos.stride(0),
        layer.scale * LOG2E.value, layer.window, layer.eps,
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, ROT_HALF=layer.rope.cos.shape[-1], PAGE_SIZE=batch.page_size,
        MODE=mode.value, RATE=rate, ENTRIES_PER_PAGE=-(-batch.page_size // rate), TOP_K=top_k,
        NUM_SPLITS=splits, BLOCK_H=block_h, BLOCK_N=cfg.block_n, BLOCK_D=triton.next_power_of_2(head_dim),
        MXFP8=mxfp8, num_warps=(mxfp8 and cfg.mxfp8_num_warps) or cfg.num_warps, num_stages=cfg.num_stages,
        **launch_options(q.device),
    )
    return result
