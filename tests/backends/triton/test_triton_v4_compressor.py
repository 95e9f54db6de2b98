"""DeepSeek-V4's compressors in one Triton launch against NativeV4Attention.compress, and the
indexer's keys quantized to E4M3 where the compressor writes them; DeepSeek-V4.1's CSA2 KV sources
(pairs pooled with no position bias, ratio-1 entries with no gate) and the index keys they derive."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from aot import (GRID_DEPENDENCY, LDS_BYTES, TARGETS, amd_scratch_and_lds, amdgcn_target, compile_asm,
                 local_memory_ops, pdl)

from engine.backends.triton import v4_compressor
from engine.backends.triton.target import pick
from engine.backends.triton.v4_attention import TritonV4Attention
from engine.backends.triton.v4_compressor import compress, compress_kernel, index_key_kernel, tiles
from engine.core.families.v4_attention import Compression, IndexerLayer, IndexKey, V4AttentionLayer
from engine.core.forward import ForwardBatch
from engine.core.kv.storage import KVCache
from engine.core.models.deepseek_v4.cache import SeqView, cache_layout, entries_of, flat
from engine.core.models.deepseek_v4.topology import CSA2Role
from engine.core.native.indexer import quantize_keys
from engine.core.native.quant import FP8
from engine.core.native.rope import RotaryEmbedding
from engine.core.native.v4_attention import NativeV4Attention

# entries pass three roundings to the cache dtype (pooled, normalised, rotated); an fp32 sum in
# another order or a softmax weight an ulp off can move one by an ulp, the next steps by two more
TOL = {torch.float32: dict(rtol=2e-6, atol=2e-6), torch.float16: dict(rtol=2e-3, atol=2e-3),
       torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}


def assert_rows_agree(got: torch.Tensor, want: torch.Tensor) -> None:
    """Nearly every entry row equals the oracle's to the bit. Counted by rows, not values: a row's
    norm an ulp off (another summation order) moves most of that row, and a case may write only
    five rows; a missing rounding step moves nearly all of them. (bf16 rows of 512 on an H100: 2
    of 40 off in one run.)"""
    rows_off = int((got != want).any(-1).sum())
    assert rows_off <= 2 + 0.1 * got.shape[0], f"{rows_off} of {got.shape[0]} rows differ in some bit"


def mixed_lens(rate: int) -> list[tuple[int, int]]:
    """(cached, new) per sequence: a decode row that closes a window, one that does not, a prefill
    from 0 past two windows, and a chunk that starts inside a window after a cached prefix (at rate
    1, where every token closes its window: decode rows, a prefill and a chunk after a prefix)."""
    if rate == 1:
        return [(random.randint(0, 9), 1), (random.randint(1, 9), 1), (0, random.randint(2, 7)),
                (random.randint(1, 9), random.randint(1, 5))]
    closing = random.randint(1, 3) * rate - 1
    open_ = random.choice([c for c in range(rate, 3 * rate) if (c + 1) % rate])
    inside = random.randint(1, 2) * rate + random.randint(1, rate - 1)
    return [(closing, 1), (open_, 1), (0, random.randint(2 * rate, 3 * rate)), (inside, random.randint(rate, 3 * rate))]


class Case:
    """A batch on shuffled pages, each with a window page; the projections of every cached position
    are random and every other projection slot and every entry slot is NaN. ``indexer``: the CSA
    indexer's compressor (its own cache layers) instead of the layer's. ``capacity``: positions each
    sequence's pages hold (a later ``fill`` may bring other lengths onto the same pages). ``fp8``: the
    indexer's keys in E4M3 with their scales, as beside FP8 weights. ``csa2``: a V4.1 KV source at
    ``rate`` 1 or 2 (no position bias; no gate at rate 1) that derives index keys of 16 channels.
    ``window``: the layer's window KV stored with the compression (``store_and_compress``), its
    pages NaN but for what the step writes. ``with_indexer``: with the window, the CSA indexer's
    compressor too (keys of ``index_dim`` channels), in the same call."""

    def __init__(self, lens, head_dim, rope_dim, rate, overlap, page_size, dtype, device, act_dtype=None,
                 indexer=False, capacity=None, fp8=False, csa2=False, window=False, with_indexer=False, index_dim=16):
        self.rate, self.page_size, self.dtype, self.device = rate, page_size, dtype, device
        self.window = window or with_indexer
        self.act_dtype = act_dtype or dtype
        main_dim, index_dim = (64, head_dim) if indexer else (head_dim, index_dim)
        roles = [CSA2Role(rate, 0, 0, keeps_index_keys=True)] if csa2 else None
        self.specs, (parts,) = cache_layout(main_dim, [rate], [overlap], index_dim, fp8_index_keys=fp8, roles=roles)
        projections, entries = ((parts.index_projections, parts.index_keys) if indexer
                                else (parts.projections, parts.entries))
        self.width = 2 * head_dim if overlap else head_dim
        self.gated = projections is not None
        capacity = capacity or max(c + q for c, q in lens)
        per_seq = -(-capacity // page_size)
        self.num_pages = len(lens) * per_seq + 3
        ids = random.sample(range(1, self.num_pages), len(lens) * per_seq)
        self.tables = [ids[i * per_seq:(i + 1) * per_seq] for i in range(len(lens))]
        self.windows = dict(zip(ids, random.sample(range(1, len(ids) + 3), len(ids))))
        rope = RotaryEmbedding(head_dim, rope_dim, capacity + rate, 10000.0, None, is_neox_style=False, device=device)
        key = None
        if csa2:
            wk = torch.randn(index_dim, head_dim, device=device) * head_dim ** -0.5
            key = IndexKey(lambda latent: latent @ wk.T.to(latent.dtype), 1 + 0.5 * torch.randn(index_dim, device=device),
                           1e-6, parts.index_keys)
        self.comp = Compression(rate=rate, overlap=overlap,
                                ape=None if csa2 else torch.randn(rate, self.width, device=device),
                                norm_weight=1 + 0.5 * torch.randn(head_dim, device=device), eps=1e-6,
                                projections=projections, entries=entries, index_key=key)
        self.written = [entries] + ([parts.index_keys] if csa2 or with_indexer else [])  # the per-entry layers
        self.ix_comp = None
        if with_indexer:
            self.ix_comp = Compression(rate=rate, overlap=overlap, ape=torch.randn(rate, 2 * index_dim, device=device),
                                       norm_weight=1 + 0.5 * torch.randn(index_dim, device=device), eps=1e-6,
                                       projections=parts.index_projections, entries=parts.index_keys)
        self.projections = [c.projections for c in (self.comp, self.ix_comp) if c is not None and c.projections]
        self.layer = V4AttentionLayer(num_heads=1, head_dim=main_dim, window=4, sinks=torch.zeros(1, device=device),
                                      rope=rope, window_kv=parts.window,
                                      kv_norm=1 + 0.5 * torch.randn(main_dim, device=device),
                                      eps=1e-6, compression=self.comp,
                                      indexer=IndexerLayer(1, index_dim, 4, self.ix_comp) if with_indexer else None)
        self.fill(lens)

    def fill(self, lens) -> None:
        """A step of these (cached, new) lengths: its batch, its projections and the cache before it."""
        self.lens = lens
        ctx, new = [c for c, _ in lens], [q for _, q in lens]
        self.batch = ForwardBatch.build(input_ids=[0] * sum(new), query_lens=new, context_lens=ctx,
                                        page_tables=self.tables, page_size=self.page_size, logits_indices=[],
                                        device=self.device)
        self.kv_proj = torch.randn(sum(new), self.width, device=self.device).to(self.act_dtype)
        self.gate_proj = (2 * torch.randn(sum(new), self.width, device=self.device)).to(self.act_dtype)
        if not self.gated:
            self.gate_proj = None
        self.kv_new = torch.randn(sum(new), self.layer.head_dim, device=self.device).to(self.act_dtype)
        self.indexer_proj = None
        if self.ix_comp is not None:
            width = 2 * self.ix_comp.head_dim
            self.indexer_proj = (torch.randn(sum(new), width, device=self.device).to(self.act_dtype),
                                 (2 * torch.randn(sum(new), width, device=self.device)).to(self.act_dtype))
        kv = self.cache(None)
        table = kv.window_table()
        projections = [t for layer in self.projections for t in flat(kv, layer)]
        for t in (*projections, *flat(kv, self.layer.window_kv), *(t for i in self.written for t in flat(kv, i))):
            t.fill_(float("nan"))
        for c, pages in zip(ctx, self.tables):
            seq = SeqView(0, c, 0, torch.tensor(pages, dtype=torch.int32, device=self.device), table, self.page_size)
            for t in projections:
                t[seq.token_slots(0, c)] = torch.randn(c, t.shape[1], device=self.device).to(t.dtype)
        self.state = [t for i in range(kv.num_layers) for t in (kv.layer(i).k, kv.layer(i).v)]

    def cache(self, state) -> KVCache:
        kv = KVCache(self.specs, self.num_pages, self.page_size, self.dtype, self.device,
                     num_window_pages=len(self.windows) + 3)
        for page, window in self.windows.items():
            kv.stage_window(page, window)
        if state is not None:
            self.restore(kv)
        return kv

    def restore(self, kv: KVCache) -> None:
        for i in range(kv.num_layers):
            kv.layer(i).k.copy_(self.state[2 * i])
            kv.layer(i).v.copy_(self.state[2 * i + 1])

    def meta(self, kv: KVCache):
        return TritonV4Attention(None).prepare(self.batch, kv)

    def native(self) -> KVCache:
        kv = self.cache(self.state)
        self._write(NativeV4Attention(None), kv, NativeV4Attention(None).prepare(self.batch, kv))
        return kv

    def triton(self) -> KVCache:
        kv = self.cache(self.state)
        self._write(TritonV4Attention(None), kv, self.meta(kv))
        return kv

    def _write(self, backend, kv: KVCache, meta) -> None:
        if self.window:
            backend.store_and_compress(self.kv_new, self.kv_proj, self.gate_proj, self.comp, self.layer, kv,
                                       self.batch, meta, indexer=self.indexer_proj)
        else:
            backend.compress(self.kv_proj, self.gate_proj, self.comp, self.layer, kv, self.batch, meta)

    def closed(self) -> int:
        return sum((c + q) // self.rate - c // self.rate for c, q in self.lens)

    def check(self, got: KVCache | None = None) -> None:
        want = self.native()
        got = self.triton() if got is None else got
        for layer in self.projections:
            for a, b in zip(flat(got, layer), flat(want, layer)):
                torch.testing.assert_close(a, b, equal_nan=True, rtol=0, atol=0)
        (window, *_), (want_window, *_) = flat(got, self.layer.window_kv), flat(want, self.layer.window_kv)
        stored = ~want_window.float().isnan().any(-1)
        assert int(stored.sum()) == (self.kv_new.shape[0] if self.window else 0)
        torch.testing.assert_close(window, want_window, equal_nan=True, **TOL[self.dtype])
        for layer in self.written:
            self._compare(got, want, layer)

    def _compare(self, got: KVCache, want: KVCache, layer: int) -> None:
        (entries, scales), (want_entries, want_scales) = entries_of(got, layer), entries_of(want, layer)
        written = ~want_entries.float().isnan().any(-1)
        assert int(written.sum()) == self.closed() > 0
        if want_scales is not None:  # E4M3: nearly every code agrees, and the values they stand for
            assert want_scales[~written].isnan().all(), "a scale written beside no entry"
            torch.testing.assert_close(scales, want_scales, equal_nan=True, **TOL[self.dtype])
            assert_rows_agree(entries[written].view(torch.uint8), want_entries[written].view(torch.uint8))
            entries, want_entries = (e.float() * s[:, None]
                                     for e, s in ((entries, scales), (want_entries, want_scales)))
            # an entry an ulp off in the cache dtype may round to the neighbouring E4M3 value; and the
            # rotation of two such entries can cancel to a small value that ulp moves far (H200,
            # 6e24b41, prefill 4096: 1 of 137,216 values 0.006 off at 0.005), so the cache dtype's
            # bound holds too
            tol = dict(rtol=2 ** -3, atol=max(want_scales.nan_to_num().amax().item() * 2 ** -9,
                                              TOL[self.dtype]["atol"]))
        else:
            tol = TOL[self.dtype]
            if self.dtype != torch.float32:  # the oracle's rounding steps: nearly every bit agrees
                assert_rows_agree(entries[written], want_entries[written])
        # every closed window's entry matches; every other slot is still NaN
        torch.testing.assert_close(entries, want_entries, equal_nan=True, **tol)


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("page_size", [4, 6])
def test_csa_interpreted(seed, dtype, page_size):
    """Rate 4 with overlapping windows: entry w pools window w-1's first half of the channels too
    (from earlier steps' pages where the window began before the step)."""
    Case(mixed_lens(4), 32, 16, 4, True, page_size, dtype, "cpu").check()


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rate,page_size", [(16, 4), (128, 16)])
def test_hca_interpreted(seed, dtype, rate, page_size):
    """Disjoint windows longer than a page: an entry per window in the page of its last token."""
    Case(mixed_lens(rate), 32, 16, rate, False, page_size, dtype, "cpu").check()


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rate,overlap,csa2", [(4, True, False), (16, False, False), (1, False, True)])
def test_window_stored_in_the_compress_launch_interpreted(seed, dtype, rate, overlap, csa2):
    """A compressed layer's window KV stored by its compressor's launch: every token's row
    normalised and turned as the native store writes it, and the compression unchanged."""
    Case(mixed_lens(rate), 32, 16, rate, overlap, 4, dtype, "cpu", csa2=csa2, window=True).check()


@pytest.mark.interpret
@pytest.mark.parametrize("rate,overlap", [(4, True), (16, False)])
def test_window_in_several_tiles_interpreted(seed, monkeypatch, rate, overlap):
    """Tiles of two slots: the softmax's maximum and sum carried from tile to tile (window 0's
    absent predecessor fills whole tiles); a head dim that is no power of two, fully rotated."""
    monkeypatch.setitem(v4_compressor.COMPRESS, "default", v4_compressor.CompressConfig(
        tile_elements=64, elements_per_warp=1 << 30, max_warps=1))
    Case(mixed_lens(rate), 24, 24, rate, overlap, 4, torch.float32, "cpu").check()


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rate,page_size", [(1, 3), (2, 3), (2, 4)])
def test_csa2_kv_source_interpreted(seed, monkeypatch, dtype, rate, page_size):
    """DeepSeek-V4.1's CSA2 KV source that indexes: rate 2 pools each pair by a softmax over its two
    gate scores with no position bias (a pair split over two steps reads its first token from the
    window pages); rate 1 keeps each token's kv row, normalised and rotated, with no gate and no
    projections. Both derive index keys from the entries' latents (projected, normalised, rotated
    as the entries); the latents' scratch starts as NaN, so a key from a row no entry wrote shows."""
    monkeypatch.setattr(v4_compressor, "_empty", lambda shape, dtype, device: torch.full(
        shape, float("nan"), dtype=dtype, device=device))
    Case(mixed_lens(rate), 32, 16, rate, False, page_size, dtype, "cpu", csa2=True).check()


@pytest.mark.interpret
@pytest.mark.parametrize("rate", [1, 2])
def test_csa2_fp8_index_keys_interpreted(seed, rate):
    """The derived index keys in E4M3 with one fp32 scale each, as beside FP8 weights."""
    Case(mixed_lens(rate), 32, 16, rate, False, 4, torch.float16, "cpu", csa2=True, fp8=True).check()


class CountedLaunches:
    """compress_kernel, its launches counted."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


@pytest.mark.interpret
@pytest.mark.parametrize("dtype,fp8", [(torch.float32, False), (torch.float16, False), (torch.float16, True)])
def test_csa_indexer_compressed_in_the_layer_launch_interpreted(seed, monkeypatch, dtype, fp8):
    """A CSA layer's window KV, its compressor and its indexer's (index keys of another head dim,
    E4M3 beside FP8 weights) in one launch, each as the native calls one by one write them."""
    counted = CountedLaunches(v4_compressor.compress_kernel)
    monkeypatch.setattr(v4_compressor, "compress_kernel", counted)
    case = Case(mixed_lens(4), 32, 16, 4, True, 4, dtype, "cpu", with_indexer=True, fp8=fp8)
    case.check()
    assert counted.launches == 1


@pytest.mark.interpret
def test_indexer_projections_beside_a_layer_without_its_compression_are_refused(seed):
    case = Case([(0, 4)], 16, 8, 4, True, 4, torch.float32, "cpu", with_indexer=True)
    kv = case.cache(case.state)
    with pytest.raises(ValueError, match="layer.indexer.compression"):
        compress(case.kv_proj, case.gate_proj, case.comp, dataclasses.replace(case.layer, indexer=None), kv,
                 case.batch, case.meta(kv), indexer=case.indexer_proj)
    with pytest.raises(ValueError, match="indexer's projections for 3 tokens"):
        compress(case.kv_proj, case.gate_proj, case.comp, case.layer, kv, case.batch, case.meta(kv),
                 indexer=tuple(x[:3] for x in case.indexer_proj))


@pytest.mark.interpret
def test_indexer_compressor_interpreted(seed):
    """The CSA indexer's own compressor, in its own cache layers (fp32 activations into fp16 pages)."""
    Case(mixed_lens(4), 16, 8, 4, True, 4, torch.float16, "cpu", act_dtype=torch.float32, indexer=True).check()


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp8_index_keys_interpreted(seed, dtype):
    """The indexer's keys in E4M3 with one fp32 scale each: quantized where the entry is written, in
    prefill, in a chunk that starts inside a window, and in decode rows that close a window."""
    Case(mixed_lens(4), 16, 8, 4, True, 4, dtype, "cpu", indexer=True, fp8=True).check()


@pytest.mark.parametrize("page_size", [4, 6])
def test_native_quantizes_each_key_as_written(seed, page_size):
    """The native compressor with E4M3 index keys writes, for every window that closes (prefill,
    a chunk inside a window, decode), exactly quantize_keys of the key the model-dtype layout keeps
    for the same step: its amax / 448 scale in V and the rotated key / scale in E4M3."""

    def case(fp8: bool) -> Case:  # the same draws for both layouts
        torch.manual_seed(seed)
        random.seed(seed)
        return Case(mixed_lens(4), 32, 16, 4, True, page_size, torch.bfloat16, "cpu", indexer=True, fp8=fp8)

    fp8, dense = case(True), case(False)
    assert torch.equal(fp8.kv_proj, dense.kv_proj) and fp8.lens == dense.lens
    keys, scales = entries_of(fp8.native(), fp8.comp.entries)
    dense_keys, none = entries_of(dense.native(), dense.comp.entries)
    assert keys.dtype == FP8 and scales.dtype == torch.float32 and dense_keys.dtype == torch.bfloat16 and none is None
    written = ~scales.isnan()
    assert int(written.sum()) == fp8.closed() and torch.equal(written, ~dense_keys.isnan().any(-1))
    data, scale = quantize_keys(dense_keys[written])
    assert torch.equal(scales[written], scale)
    assert torch.equal(keys[written].view(torch.uint8), data.view(torch.uint8))


@pytest.mark.interpret
def test_bad_projection_width_is_refused(seed):
    case = Case([(0, 4)], 16, 8, 4, True, 4, torch.float32, "cpu")
    kv = case.cache(case.state)
    with pytest.raises(ValueError, match="kv_proj"):
        compress(case.kv_proj[:, :16], case.gate_proj[:, :16], case.comp, case.layer, kv, case.batch, case.meta(kv))


FLASH = {"csa": dict(head_dim=512, rate=4, overlap=True), "hca": dict(head_dim=512, rate=128, overlap=False),
         # a CSA layer's window KV, compressor and indexer's compressor in one launch (keys of 128, E4M3 or not)
         "csa+indexer": dict(head_dim=512, rate=4, overlap=True, with_indexer=True, index_dim=128),
         "csa+indexer-fp8": dict(head_dim=512, rate=4, overlap=True, with_indexer=True, index_dim=128, fp8=True),
         "indexer": dict(head_dim=128, rate=4, overlap=True, indexer=True),
         "indexer-fp8": dict(head_dim=128, rate=4, overlap=True, indexer=True, fp8=True),
         # V4.1-Flash's CSA2 KV sources, their index keys of 128 channels (the rope's 64 rotate their tail)
         "csa2-pairs": dict(head_dim=512, rate=2, overlap=False, csa2=True, index_dim=128),
         "csa2-tokens": dict(head_dim=512, rate=1, overlap=False, csa2=True, fp8=True, index_dim=128)}


def flash_case(kind: str, lens, capacity=None) -> Case:
    shape = dict(FLASH[kind])
    return Case(lens, shape.pop("head_dim"), 64, shape.pop("rate"), shape.pop("overlap"), 64, torch.bfloat16, "cuda",
                capacity=capacity, **shape)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", sorted(FLASH))
@pytest.mark.parametrize("batch", ["prefill-4096", "mixed", "decode-128"])
def test_flash_shapes_gpu(seed, kind, batch):
    """bf16 at DeepSeek-V4-Flash's compressor shapes."""
    rate = FLASH[kind]["rate"]
    lens = {"prefill-4096": [(0, 4096)],
            "mixed": mixed_lens(rate) + [(1000, 3000), (rate * 7 + 3, 1500)],
            "decode-128": [(random.randint(1, 8191), 1) for _ in range(96)] +
                          [(rate * random.randint(1, 60) - 1, 1) for _ in range(32)]}[batch]
    flash_case(kind, lens).check()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", sorted(FLASH))
def test_flash_decode_graph_gpu(seed, kind):
    """Captured once on a decode batch of 32, replayed on new projections (and window KV) at new
    positions (rows that close a window and rows that do not) over the same pages: each replay
    equals the oracle."""
    rate = FLASH[kind]["rate"]

    def lens():
        return [(rate * random.randint(2, 12) - random.choice([1, 2]), 1) for _ in range(32)]

    case = flash_case(kind, lens(), capacity=12 * rate)
    kv, batch = case.cache(case.state), case.batch
    inputs = [x for x in (case.kv_proj, case.gate_proj, case.kv_new, *(case.indexer_proj or ())) if x is not None]
    meta = case.meta(kv)
    backend = TritonV4Attention(None)
    case._write(backend, kv, meta)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        case._write(backend, kv, meta)
    for _ in range(3):
        case.fill(lens())
        case.restore(kv)
        for name in ("positions", "query_start_loc", "page_table", "slot_mapping"):
            getattr(batch, name).copy_(getattr(case.batch, name))
        meta.window_slots.copy_(case.meta(kv).window_slots)
        new = [x for x in (case.kv_proj, case.gate_proj, case.kv_new, *(case.indexer_proj or ())) if x is not None]
        for captured, fresh in zip(inputs, new):  # rate 1 (CSA2) has no gate
            captured.copy_(fresh)
        graph.replay()
        case.check(got=kv)


@pytest.mark.aot
@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("kind", sorted(FLASH))
def test_compress_compiles(target, kind):
    """V4-Flash's three compressors in bf16 (the indexer's also with E4M3 keys) and V4.1-Flash's CSA2
    KV sources (pairs without a position bias, tokens without a gate, each leaving its latents):
    16-byte loads of the window tiles, and (as launched, without FP fusion) no fused multiply-add
    that would skip one of the oracle's roundings; the layers' own compressors store the window KV
    in the same launch (programs of their own), a CSA layer's also running its indexer's compressor
    there, without spills or scratch."""
    shape = FLASH[kind]
    head_dim, rate, overlap, csa2 = shape["head_dim"], shape["rate"], shape["overlap"], shape.get("csa2", False)
    with_indexer = shape.get("with_indexer", False)
    # E4M3 entries: the indexer's compressor's alone (a CSA2 source's E4M3 keys are index_key_kernel's)
    fp8 = shape.get("fp8", False) and not csa2 and not with_indexer
    ix_fp8 = shape.get("fp8", False) and with_indexer
    width = 2 * head_dim if overlap else head_dim
    strides = [name for name in compress_kernel.arg_names if name.startswith("stride_")]
    signature = {**{p: "*bf16" for p in ("kv_ptr", "gate_ptr", "kv_cache_ptr", "gate_cache_ptr")},
                 "entry_ptr": "*fp8e4nv" if fp8 else "*bf16",
                 **{p: "*fp32" for p in ("entry_scale_ptr", "ape_ptr", "norm_ptr", "cos_ptr", "sin_ptr")},
                 "positions_ptr": "*i64", "window_slots_ptr": "*i64", "latent_ptr": "*bf16",
                 **{p: "*i32" for p in ("token_seq_ptr", "window_table_ptr", "page_table_ptr", "query_start_ptr")},
                 "eps": "fp32", **{s: "i32" for s in strides},
                 "win_ptr": "*bf16", "win_norm_ptr": "*fp32", "win_cache_ptr": "*bf16", "win_eps": "fp32",
                 **{f"ix_{p}": "*bf16" for p in ("kv_ptr", "gate_ptr", "kv_cache_ptr", "gate_cache_ptr")},
                 "ix_entry_ptr": "*fp8e4nv" if ix_fp8 else "*bf16", "ix_eps": "fp32",
                 **{f"ix_{p}": "*fp32" for p in ("entry_scale_ptr", "ape_ptr", "norm_ptr")}}
    window = not shape.get("indexer", False)  # a layer's own compressor stores its window KV (512) too
    num_slots = 2 * rate if overlap else rate
    block_d, block_s, num_warps = tiles(head_dim, num_slots, pick(v4_compressor.COMPRESS, target))
    indexer = dict(INDEXER=False, IX_WIDTH=1, IX_HEAD_DIM=1, IX_QUANTIZE=False, IX_BLOCK_W=1, IX_BLOCK_S=1,
                   IX_BLOCK_D=2)  # the kernel's defaults
    if with_indexer:
        index_dim = shape["index_dim"]
        ix_block_d, ix_block_s, ix_warps = tiles(index_dim, num_slots, pick(v4_compressor.COMPRESS, target))
        indexer = dict(INDEXER=True, IX_WIDTH=2 * index_dim, IX_HEAD_DIM=index_dim, IX_QUANTIZE=ix_fp8,
                       IX_BLOCK_W=2 * index_dim, IX_BLOCK_S=ix_block_s, IX_BLOCK_D=ix_block_d)
        num_warps = max(num_warps, ix_warps)
    constexprs = dict(WIDTH=width, HEAD_DIM=head_dim, ROPE_HALF=32, RATE=rate, OVERLAP=int(overlap),
                      NUM_SLOTS=num_slots, PAGE_SIZE=64, ENTRIES_PER_PAGE=-(-64 // rate), QUANTIZE=fp8, BLOCK_W=width,
                      BLOCK_S=block_s, BLOCK_D=block_d, PDL=pdl(target), GATED=rate > 1 or not csa2,
                      HAS_APE=not csa2, LATENT=csa2, WINDOW=window, WIN_DIM=512, WIN_BLOCK=512, **indexer)
    asm = compile_asm(compress_kernel, signature, constexprs, target, num_warps=num_warps, divisible_by_16=strides,
                      enable_fp_fusion=False, sass=window and target.startswith("sm_"))
    if target.startswith("sm_"):
        ptx = asm["ptx"]
        assert f".target {target}a" in ptx
        assert "ld.global.v4.b32" in ptx
        assert "fma.rn" not in ptx
        assert all(op in ptx for op in GRID_DEPENDENCY)
        if window:
            assert local_memory_ops(asm["sass"]) == 0
    else:
        gcn = asm["amdgcn"]
        assert target in amdgcn_target(gcn)
        assert "global_load_dwordx4" in gcn
        scratch, lds = amd_scratch_and_lds(asm)  # the "hip" tiles: 2048 elements a 64-wide wave
        assert scratch == 0 and lds <= LDS_BYTES[target]


@pytest.mark.aot
@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("key_dtype", ["bf16", "fp8e4nv"])
def test_index_key_compiles(target, key_dtype):
    """V4.1-Flash's derived index keys (128 channels, rope 64) from bf16 projected latents, kept in bf16
    or E4M3 with their scales: no fused multiply-add skips a rounding of the norm or the rotation."""
    strides = [name for name in index_key_kernel.arg_names if name.startswith("stride_")]
    signature = {"proj_ptr": "*bf16", "key_ptr": f"*{key_dtype}", "positions_ptr": "*i64", "token_seq_ptr": "*i32",
                 "page_table_ptr": "*i32", "eps": "fp32",
                 **{p: "*fp32" for p in ("norm_ptr", "key_scale_ptr", "cos_ptr", "sin_ptr")},
                 **{s: "i32" for s in strides}}
    constexprs = dict(HEAD_DIM=128, ROPE_HALF=32, RATE=2, PAGE_SIZE=64, ENTRIES_PER_PAGE=32,
                      QUANTIZE=key_dtype == "fp8e4nv", BLOCK_D=128, PDL=pdl(target))
    asm = compile_asm(index_key_kernel, signature, constexprs, target, num_warps=1, divisible_by_16=strides,
                      enable_fp_fusion=False)
    if target.startswith("sm_"):
        assert f".target {target}a" in asm["ptx"] and "fma.rn" not in asm["ptx"]
        assert all(op in asm["ptx"] for op in GRID_DEPENDENCY)
    else:
        assert target in amdgcn_target(asm["amdgcn"])
