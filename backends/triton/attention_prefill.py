"""Paged prefill attention: a varlen batch of new queries over keys and values read from pages.

The new tokens' K/V are already in their pages, so the pages are the only source of keys: a
cached prefix and the step's own tokens are read the same way. One program takes ``BLOCK_M``
rows of one sequence, a row being one (query token, query head) pair of the query heads that
share a KV head: under GQA/MQA every key block is loaded once for the whole group. Online softmax
in fp32 (exp2 domain); a sink is one more logit per head that joins the denominator at the end.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from engine.core.families.attention import AttentionLayer, LayerKV

from .target import config_for

LOG2E = tl.constexpr(1.4426950408889634)  # softmax runs in exp2: scores and sinks are scaled by it


@dataclass(frozen=True)
class PrefillConfig:
    block_m: int  # rows (query token x group head) per program
    block_n: int  # keys per inner step
    num_warps: int
    num_stages: int

    def for_itemsize(self, itemsize: int) -> PrefillConfig:
        """The tiles for q/k/v of ``itemsize`` bytes: the table's hold bf16; 4-byte ones take half the
        rows and half the keys, so that the tiles keep bf16's bytes. At the table's tiles fp32 took 321
        KiB of shared memory at head dim 128 on sm_90 (AOT), over the 227 a block may take."""
        if itemsize <= 2:
            return self
        return replace(self, block_m=max(16, self.block_m // 2), block_n=max(16, self.block_n // 2))


# keyed by arch, then by the padded head dim (the larger of head_dim and v_head_dim)
P = PrefillConfig
PREFILL = {  # sm_90 measured on an H200 (bf16, causal, GQA 4-8); the others are first guesses
    "sm_90": {64: P(128, 64, 4, 3), 128: P(128, 128, 8, 3), 256: P(128, 64, 8, 2), 512: P(32, 32, 4, 2)},
    "sm_100": {64: P(128, 64, 4, 3), 128: P(128, 128, 8, 3), 256: P(128, 64, 8, 2), 512: P(32, 32, 4, 2)},
    "gfx942": {64: P(128, 64, 4, 1), 128: P(128, 64, 8, 1), 256: P(64, 64, 8, 1), 512: P(32, 32, 4, 1)},
    "gfx950": {64: P(128, 64, 4, 2), 128: P(128, 64, 8, 2), 256: P(64, 64, 8, 1), 512: P(32, 32, 4, 1)},
    "default": {64: P(64, 32, 4, 1), 128: P(64, 32, 4, 1), 256: P(32, 32, 4, 1), 512: P(16, 16, 4, 1)},
}


def pick_dim(configs: dict[int, object], dim: int):
    """The entry of the smallest head-dim bucket that holds ``dim``."""
    fits = [d for d in configs if d >= dim]
    if not fits:
        raise ValueError(f"head dim {dim} exceeds the largest tuned one ({max(configs)})")
    return configs[min(fits)]


@triton.jit
def _attend_keys(q, acc, m_i, l_i, k_ptr, v_ptr, pages_row, kv_head, q_pos, start, end, hi, qk_scale, window,
                 stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                 HEAD_DIM: tl.constexpr, V_HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                 CAUSAL: tl.constexpr, SLIDING: tl.constexpr, MASKED: tl.constexpr):
    """Online softmax over keys [start, end); ``MASKED`` blocks check each key against ``hi``, the
    causal edge and the window, the others are seen whole by every row."""
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    d_ok = offs_d < HEAD_DIM
    dv_ok = offs_dv < V_HEAD_DIM
    for first in range(start, end, BLOCK_N):
        n = first + tl.arange(0, BLOCK_N)
        if MASKED:
            n_ok = n < hi
            page = tl.load(pages_row + n // PAGE_SIZE, mask=n_ok, other=0).to(tl.int64)
            k_ok = n_ok[:, None] & d_ok[None, :]
            # masked slots may hold anything, NaN included: load them as 0 so 0 * NaN cannot leak in
            v_ok = n_ok[:, None] & dv_ok[None, :]
        else:
            page = tl.load(pages_row + n // PAGE_SIZE).to(tl.int64)
            k_ok = d_ok[None, :]
            v_ok = dv_ok[None, :]
        slot = n % PAGE_SIZE
        # keys load row-major like the values, then transpose in registers: faster than a
        # column-major gather on sm_90 (0.60 against 0.54 of SDPA at head dim 128)
        k = tl.load(k_ptr + page[:, None] * stride_kp + slot[:, None] * stride_ks + kv_head * stride_kh
                    + offs_d[None, :], mask=k_ok, other=0.0)
        s = tl.dot(q, tl.trans(k))
        if MASKED:
            visible = n_ok[None, :]
            if CAUSAL:
                visible = visible & (n[None, :] <= q_pos[:, None])
            if SLIDING:
                visible = visible & (n[None, :] > q_pos[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
        # the scale folds into the exponent's multiply-add: one op per score, not two
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s * qk_scale - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + page[:, None] * stride_vp + slot[:, None] * stride_vs + kv_head * stride_vh
                    + offs_dv[None, :], mask=v_ok, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, m_i, l_i


# the page-table row stride is the batch's widest page count: specialized on it, a kernel would
# compile again whenever a step's longest context crossed into another class (1 page, 16k pages)
@triton.jit(do_not_specialize=["stride_pt"])
def prefill_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, sinks_ptr,
    page_table_ptr, query_start_ptr, seq_lens_ptr, seq_ids_ptr,
    stride_qt, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    stride_ot, stride_oh, stride_pt,
    qk_scale, window,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, V_HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    CAUSAL: tl.constexpr, SLIDING: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    # the last row blocks of a causal sequence see the most keys: launch them first
    block = tl.num_programs(0) - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(seq_ids_ptr + tl.program_id(2))
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    num_rows = q_len * GROUP
    if block * BLOCK_M >= num_rows:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len

    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < num_rows
    tok = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    q_pos = context + tok
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = tl.load(q_ptr + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)

    # keys [lo, hi) are seen by some row of the block; the key blocks in [full_lo, full_hi) by all
    first_pos = context + (block * BLOCK_M) // GROUP
    last_pos = context + (tl.minimum((block + 1) * BLOCK_M, num_rows) - 1) // GROUP
    hi = last_pos + 1 if CAUSAL else seq_len
    lo = tl.maximum(first_pos - window + 1, 0) if SLIDING else 0
    full_lo = lo + tl.cdiv(tl.maximum(last_pos - window + 1 - lo, 0), BLOCK_N) * BLOCK_N if SLIDING else lo
    full_lo = tl.minimum(full_lo, hi)
    full_hi = lo + ((first_pos + 1 if CAUSAL else seq_len) - lo) // BLOCK_N * BLOCK_N
    full_hi = tl.maximum(full_hi, full_lo)

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)  # finite: a fully masked key block gives p = 0, not NaN
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    pages_row = page_table_ptr + seq * stride_pt
    args = (k_ptr, v_ptr, pages_row, kv_head, q_pos)
    strides = (stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh)
    acc, m_i, l_i = _attend_keys(q, acc, m_i, l_i, *args, lo, full_lo, hi, qk_scale, window, *strides,
                                 HEAD_DIM, V_HEAD_DIM, PAGE_SIZE, BLOCK_N, BLOCK_D, BLOCK_DV, CAUSAL, SLIDING, True)
    acc, m_i, l_i = _attend_keys(q, acc, m_i, l_i, *args, full_lo, full_hi, hi, qk_scale, window, *strides,
                                 HEAD_DIM, V_HEAD_DIM, PAGE_SIZE, BLOCK_N, BLOCK_D, BLOCK_DV, CAUSAL, SLIDING, False)
    acc, m_i, l_i = _attend_keys(q, acc, m_i, l_i, *args, full_hi, hi, hi, qk_scale, window, *strides,
                                 HEAD_DIM, V_HEAD_DIM, PAGE_SIZE, BLOCK_N, BLOCK_D, BLOCK_DV, CAUSAL, SLIDING, True)

    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0) * LOG2E
        m_f = tl.maximum(m_i, sink)
        rescale = tl.exp2(m_i - m_f)
        acc = acc * (rescale / (l_i * rescale + tl.exp2(sink - m_f)))[:, None]
    else:
        acc = acc / tl.where(row_ok, l_i, 1.0)[:, None]  # padding rows may see no key at all
    tl.store(out_ptr + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + offs_dv[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < V_HEAD_DIM))


def prefill_attention(q: torch.Tensor, kv: LayerKV, layer: AttentionLayer, out: torch.Tensor,
                      page_table: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                      seq_ids: torch.Tensor, max_query_len: int) -> None:
    """Attend the new queries of sequences ``seq_ids`` (q, out: [T, H, D|Dv], packed by
    ``query_start_loc``) over their first ``seq_lens`` keys in ``kv``'s pages."""
    num_seqs = seq_ids.shape[0]
    if num_seqs == 0 or max_query_len == 0:
        return
    head_dim, v_head_dim = kv.k.shape[-1], kv.v.shape[-1]
    group = layer.num_heads // layer.num_kv_heads
    cfg = pick_dim(config_for(PREFILL, q.device), max(head_dim, v_head_dim)).for_itemsize(q.element_size())
    grid = (triton.cdiv(max_query_len * group, cfg.block_m), layer.num_kv_heads, num_seqs)
    prefill_attention_kernel[grid](
        q, kv.k, kv.v, out, layer.sinks,
        page_table, query_start_loc, seq_lens, seq_ids,
        q.stride(0), q.stride(1), kv.k.stride(0), kv.k.stride(1), kv.k.stride(2),
        kv.v.stride(0), kv.v.stride(1), kv.v.stride(2),
        out.stride(0), out.stride(1), page_table.stride(0),
        layer.scale * LOG2E.value, layer.sliding_window or 0,
        GROUP=group, HEAD_DIM=head_dim, V_HEAD_DIM=v_head_dim, PAGE_SIZE=kv.k.shape[1],
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_DV=triton.next_power_of_2(v_head_dim),
        CAUSAL=layer.causal, SLIDING=layer.sliding_window is not None, HAS_SINKS=layer.sinks is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
