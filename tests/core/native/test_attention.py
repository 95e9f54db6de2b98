"""Native paged attention against a dense per-sequence reference with an explicit mask."""

from __future__ import annotations

import random

import pytest
import torch

from engine.core.families.attention import AttentionLayer, LayerKV
from engine.core.forward import ForwardBatch
from engine.core.native import attention as native_attention
from engine.core.native.attention import NativeAttention


def dense_reference(q, k_full, v_full, context_len, layer):
    """q [Tq, H, D] at positions context_len.., over k/v [L, Hkv, *] of the whole sequence."""
    tq, seq_len = q.shape[0], k_full.shape[0]
    group = layer.num_heads // layer.num_kv_heads
    k = k_full.float().repeat_interleave(group, dim=1)
    v = v_full.float().repeat_interleave(group, dim=1)
    logits = torch.einsum("thd,lhd->htl", q.float(), k) * layer.scale
    mask = torch.ones(tq, seq_len, dtype=torch.bool)
    if layer.causal:
        mask = mask.tril(diagonal=context_len)
    if layer.sliding_window is not None:
        mask &= torch.ones(tq, seq_len, dtype=torch.bool).triu(diagonal=context_len - layer.sliding_window + 1)
    logits = logits.masked_fill(~mask, float("-inf"))
    top = logits.amax(dim=-1, keepdim=True)
    denom = (logits - top).exp().sum(dim=-1, keepdim=True)
    if layer.sinks is not None:
        sink = layer.sinks.float()[:, None, None]
        top2 = torch.maximum(top, sink)
        denom = (logits - top2).exp().sum(dim=-1, keepdim=True) + (sink - top2).exp()
        top = top2
    probs = (logits - top).exp() / denom
    return torch.einsum("htl,lhd->thd", probs, v)


class Setup:
    """Sequences with random page lists in a NaN-filled pool; prefixes already written to their pages."""

    def __init__(self, lens, layer, page_size, dtype=torch.float32, num_extra_pages=5):
        self.layer, self.page_size, self.lens = layer, page_size, lens
        dv = layer.v_head_dim or layer.head_dim
        need = [-(-(c + q) // page_size) for c, q in lens]
        num_pages = 1 + sum(need) + num_extra_pages
        ids = list(range(1, num_pages))
        random.shuffle(ids)
        self.page_tables = []
        for n in need:
            self.page_tables.append(ids[:n])
            ids = ids[n:]
        shape = (num_pages, page_size, layer.num_kv_heads)
        self.kv = LayerKV(k=torch.full((*shape, layer.head_dim), float("nan"), dtype=dtype),
                          v=torch.full((*shape, dv), float("nan"), dtype=dtype))
        self.full_k, self.full_v = [], []
        for (c, q), pages in zip(lens, self.page_tables):
            k = torch.randn(c + q, layer.num_kv_heads, layer.head_dim).to(dtype)
            v = torch.randn(c + q, layer.num_kv_heads, dv).to(dtype)
            for pos in range(c):
                self.kv.k[pages[pos // page_size], pos % page_size] = k[pos]
                self.kv.v[pages[pos // page_size], pos % page_size] = v[pos]
            self.full_k.append(k)
            self.full_v.append(v)
        self.q = [torch.randn(q, layer.num_heads, layer.head_dim).to(dtype) for _, q in lens]
        ctx, qlens = [c for c, _ in lens], [q for _, q in lens]
        self.batch = ForwardBatch.build(input_ids=[0] * sum(qlens), query_lens=qlens, context_lens=ctx,
                                        page_tables=self.page_tables, page_size=page_size,
                                        logits_indices=[])

    def new(self, tensors):
        return torch.cat([t[c:] for t, (c, _) in zip(tensors, self.lens)])

    def run(self, prepare=True):
        backend = NativeAttention(ctx=None)
        if prepare:
            self.batch.attn_metadata = backend.prepare(self.batch)
        return backend.forward(torch.cat(self.q), self.new(self.full_k), self.new(self.full_v), self.kv,
                               self.layer, self.batch)

    def reference(self):
        return torch.cat([dense_reference(q, k, v, c, self.layer)
                          for q, k, v, (c, _) in zip(self.q, self.full_k, self.full_v, self.lens)])


def make_layer(heads=4, kv_heads=2, head_dim=64, v_head_dim=None, window=None, sinks=False, causal=True):
    return AttentionLayer(layer_id=0, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                          scale=head_dim**-0.5 * 1.3, v_head_dim=v_head_dim, sliding_window=window,
                          sinks=torch.randn(heads) if sinks else None, causal=causal)


BATCHES = {
    "prefill": [(0, 7), (0, 1), (0, 19)],
    "cached_prefix": [(5, 6), (16, 3), (1, 12)],
    "decode": [(0, 1), (6, 1), (17, 1), (32, 1)],
    "mixed": [(9, 1), (0, 13), (4, 5), (21, 1)],
    "verify": [(3, 4), (6, 4), (13, 4), (0, 4)],  # K+1 = 4 tokens each, causal among them, across pages
}


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("kind", list(BATCHES))
def test_matches_dense_reference(seed, page_size, kind):
    s = Setup(BATCHES[kind], make_layer(), page_size)
    out = s.run()
    assert out.shape == (s.batch.num_tokens, 4, 64) and out.dtype == torch.float32
    torch.testing.assert_close(out, s.reference(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", list(BATCHES))
@pytest.mark.parametrize(
    "layer_args",
    [dict(heads=4, kv_heads=4), dict(heads=8, kv_heads=1), dict(heads=6, kv_heads=2, head_dim=128),
     dict(heads=4, kv_heads=2, head_dim=64, v_head_dim=32), dict(window=4), dict(window=1),
     dict(sinks=True), dict(causal=False), dict(heads=8, kv_heads=2, window=5, sinks=True, head_dim=128)],
    ids=["mha", "mqa", "gqa_d128", "v_dim", "window", "window1", "sinks", "bidirectional", "all"])
def test_variants(seed, kind, layer_args):
    s = Setup(BATCHES[kind], make_layer(**layer_args), page_size=4)
    torch.testing.assert_close(s.run(prepare=kind != "mixed"), s.reference(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["cached_prefix", "decode", "verify"])
def test_chunked_work_matches(seed, monkeypatch, kind):
    """Tiny budget: every query (prefill) or sequence (decode) in its own chunk."""
    s = Setup(BATCHES[kind], make_layer(window=6, sinks=True), page_size=4)
    monkeypatch.setattr(native_attention, "CHUNK_ELEMENTS", 1)
    torch.testing.assert_close(s.run(), s.reference(), rtol=1e-5, atol=1e-5)


def test_writes_only_the_step_slots(seed):
    s = Setup(BATCHES["mixed"], make_layer(), page_size=4)
    before_k, before_v = s.kv.k.clone(), s.kv.v.clone()
    s.run()
    slots = s.batch.slot_mapping
    k_flat, v_flat = s.kv.k.view(-1, 2, 64), s.kv.v.view(-1, 2, 64)
    torch.testing.assert_close(k_flat[slots], s.new(s.full_k), rtol=0, atol=0)
    torch.testing.assert_close(v_flat[slots], s.new(s.full_v), rtol=0, atol=0)
    untouched = torch.ones(k_flat.shape[0], dtype=torch.bool)
    untouched[slots] = False
    torch.testing.assert_close(k_flat[untouched], before_k.view(-1, 2, 64)[untouched], rtol=0, atol=0,
                               equal_nan=True)
    torch.testing.assert_close(v_flat[untouched], before_v.view(-1, 2, 64)[untouched], rtol=0, atol=0,
                               equal_nan=True)


def test_bf16_returns_q_dtype(seed):
    s = Setup(BATCHES["mixed"], make_layer(sinks=True, window=7), page_size=4, dtype=torch.bfloat16)
    out = s.run()
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), s.reference(), rtol=1e-2, atol=1e-2)


def test_decode_equals_last_prefill_row(seed):
    """A sequence decoded at position p gives what a prefill over 0..p gives at its last row."""
    layer = make_layer(heads=4, kv_heads=1, window=9, sinks=True)
    decode = Setup([(23, 1)], layer, page_size=4)
    prefill = Setup([(0, 24)], layer, page_size=4)
    prefill.full_k, prefill.full_v = decode.full_k, decode.full_v
    prefill.q = [torch.cat([torch.randn(23, 4, 64), decode.q[0]])]
    torch.testing.assert_close(decode.run(), prefill.run()[-1:], rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_cuda_matches_cpu(seed):
    s = Setup(BATCHES["mixed"], make_layer(heads=8, kv_heads=2, window=5, sinks=True), page_size=4)
    expected = s.run()
    dec = Setup(BATCHES["decode"], make_layer(heads=8, kv_heads=2, sinks=True), page_size=4)
    expected_dec = dec.run()
    for setup, ref in ((s, expected), (dec, expected_dec)):
        cuda = ForwardBatch.build(input_ids=[0] * setup.batch.num_tokens, query_lens=setup.batch.query_lens_cpu,
                                  context_lens=setup.batch.context_lens_cpu, page_tables=setup.page_tables,
                                  page_size=setup.page_size, logits_indices=[], device="cuda")
        layer = AttentionLayer(**{**setup.layer.__dict__, "sinks": setup.layer.sinks.cuda()})
        kv = LayerKV(setup.kv.k.cuda(), setup.kv.v.cuda())
        out = NativeAttention(ctx=None).forward(torch.cat(setup.q).cuda(), setup.new(setup.full_k).cuda(),
                                                setup.new(setup.full_v).cuda(), kv, layer, cuda)
        torch.testing.assert_close(out.cpu(), ref, rtol=1e-4, atol=1e-4)
