"""The Triton V4 attention backend against the native oracle: the window store (the KV's RMSNorm,
then its rope tail turned) and the attention over window keys, entries (HCA: all visible; CSA: the
picks) and sinks, with q's per-head RMSNorm and rope tail on load and the tail turned back on the
output."""

from __future__ import annotations

import random
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

from aot import LDS_BYTES, TARGETS, amd_scratch_and_lds, amdgcn_target, compile_asm, local_memory_ops, pdl

from engine.backends.triton.descriptors import triton_descriptors
from engine.backends.triton.v4_attention import TritonV4Attention, token_metadata, token_metadata_kernel
from engine.backends.triton.target import pick
from engine.backends.triton.v4_window import store_window_kernel
from engine.backends.triton.v4_sparse_attention import DENSE, PICKED, sparse_attention_kernel
from engine.core.families.v4_attention import Compression, IndexerLayer, V4AttentionLayer
from engine.core.forward import ForwardBatch
from engine.core.kv.storage import KVCache
from engine.core.models.deepseek_v4.cache import SeqView, cache_layout, flat, window_slots
from engine.core.native import quant
from engine.core.native.rope import RotaryEmbedding
from engine.core.native.v4_attention import NativeV4Attention
from engine.core.platform import PlatformSpec
from engine.core.registry import SelectionContext

TOL = {torch.float32: dict(rtol=2e-5, atol=2e-5), torch.float16: dict(rtol=4e-3, atol=4e-3),
       torch.bfloat16: dict(rtol=3e-2, atol=3e-2)}
INDEX_DIM = 8


class Case:
    """One V4 layer (``kind``: sliding, hca or csa) over a batch of (cached, new) sequences on shuffled
    pages and window pages, every cache slot NaN but those the sequences own."""

    def __init__(self, lens, kind, heads, head_dim, rope_dim, window, rate, top_k, page_size, dtype, device="cpu",
                 max_position=1024):
        self.lens, self.kind, self.dtype, self.device = lens, kind, dtype, device
        specs, (cache,) = cache_layout(head_dim, [0 if kind == "sliding" else rate], [kind == "csa"], INDEX_DIM)
        need = [-(-(c + n) // page_size) for c, n in lens]
        num_pages = sum(need) + 2
        ids = random.sample(range(1, num_pages), sum(need))  # page 0 is the null page
        self.tables = tables = [ids[sum(need[:i]):sum(need[:i + 1])] for i in range(len(lens))]
        self.kv = KVCache(specs, num_pages, page_size, dtype, device, num_window_pages=sum(need) + 3)
        for page, window_page in zip(ids, random.sample(range(1, sum(need) + 3), sum(need))):
            self.kv.stage_window(page, window_page)
        ctx, new = [c for c, _ in lens], [n for _, n in lens]
        self.batch = ForwardBatch.build([0] * sum(new), new, ctx, tables, page_size, [], device=device)
        self.rope = RotaryEmbedding(head_dim, rope_dim, max_position, 10000.0, None, is_neox_style=False,
                                    device=device)
        comp = index = None
        if kind != "sliding":
            width = 2 * head_dim if kind == "csa" else head_dim
            comp = Compression(rate, kind == "csa", torch.zeros(rate, width, device=device),
                               torch.ones(head_dim, device=device), 1e-6, cache.projections, cache.entries)
        if kind == "csa":
            index = IndexerLayer(16, INDEX_DIM, top_k, Compression(rate, True, torch.zeros(rate, 2 * INDEX_DIM),
                                                                  torch.ones(INDEX_DIM), 1e-6,
                                                                  cache.index_projections, cache.index_keys))
        kv_norm = 1 + 0.5 * torch.randn(head_dim, device=device)
        self.layer = V4AttentionLayer(heads, head_dim, window, torch.randn(heads, device=device), self.rope,
                                      cache.window, kv_norm, 1e-6, comp, index)
        self.top_k = top_k
        self.native, self.triton = NativeV4Attention(None), TritonV4Attention(None)

    def seqs(self) -> list[SeqView]:
        return self.native.prepare(self.batch, self.kv).seqs

    def fill(self) -> None:
        """Random window KV at every position of every sequence (the new ones too), random entries up
        to each sequence's end; NaN everywhere else."""
        window_kv = flat(self.kv, self.layer.window_kv)[0].fill_(float("nan"))
        comp = self.layer.compression
        entries = None if comp is None else flat(self.kv, comp.entries)[0].fill_(float("nan"))
        for seq in self.seqs():
            slots = seq.token_slots(0, seq.end)
            window_kv[slots] = torch.randn(len(slots), window_kv.shape[1], device=self.device).to(self.dtype)
            if entries is not None:
                slots = seq.entry_slots(0, seq.end // comp.rate, comp.rate)
                entries[slots] = torch.randn(len(slots), entries.shape[1], device=self.device).to(self.dtype)

    def picks(self, padding_last: bool = False) -> torch.Tensor | None:
        """Per token a random set of its visible entries (as many as there are, up to top_k, sometimes
        fewer), -1 elsewhere, in random order (``padding_last``: the -1s after the entries); None
        where the case has no top_k (a layer that attends every visible entry) or no entries (sliding)."""
        if not self.top_k or self.layer.compression is None:
            return None
        rows = []
        for p in self.batch.positions.tolist():
            visible = (p + 1) // self.layer.compression.rate
            chosen = random.sample(range(visible), min(self.top_k, random.choice([visible, visible // 2])))
            row = chosen + [-1] * (self.top_k - len(chosen))
            if not padding_last:
                random.shuffle(row)
            rows.append(row)
        return torch.tensor(rows, dtype=torch.int32, device=self.device)

    def queries(self) -> torch.Tensor:
        """Raw queries, each head at its own scale (attend normalises them)."""
        scale = torch.rand(1, self.layer.num_heads, 1, device=self.device) * 4 + 0.5
        return (torch.randn(self.batch.num_tokens, self.layer.num_heads, self.layer.head_dim,
                            device=self.device) * scale).to(self.dtype)

    def check_attend(self, padding_last: bool = False) -> None:
        self.fill()
        q, picks = self.queries(), self.picks(padding_last)
        want = self.native.attend(q, self.layer, self.kv, self.batch, self.native.prepare(self.batch, self.kv), picks)
        got = self.triton.attend(q, self.layer, self.kv, self.batch, self.triton.prepare(self.batch, self.kv), picks)
        assert got.dtype == q.dtype and not got.isnan().any()
        torch.testing.assert_close(got, want, **TOL[self.dtype])

    def check_attend_mxfp8(self, padding_last: bool = False) -> None:
        """The epilogue's MXFP8 against its own output unquantized, quantized by core/native: bit-equal
        (the same values in, the same arithmetic). Against the oracle's output quantized the same
        way: within one E4M3 step (of the coarser block scale) beyond where the unquantized outputs
        differ, which they do by fp32 ordering and, in fp16, by the probabilities rounded to fp16
        before the weighted sum: a value near a rounding boundary, or a block's amax near a power
        of two, lands one step apart."""
        self.fill()
        q, picks = self.queries(), self.picks(padding_last)
        emitting = TritonV4Attention(SimpleNamespace(engine_config=SimpleNamespace(mxfp8_attention=True)))
        assert emitting.emits_mxfp8 and not self.triton.emits_mxfp8
        with poisoned_allocations():
            got = emitting.attend(q, self.layer, self.kv, self.batch, emitting.prepare(self.batch, self.kv), picks)
        assert got.dtype == q.dtype and got.data.dtype == quant.FP8 and got.shape == q.shape
        dense = self.triton.attend(q, self.layer, self.kv, self.batch, self.triton.prepare(self.batch, self.kv), picks)
        if self.device == "cpu":
            data, scale = quant.quantize_mxfp8(dense)
            assert torch.equal(got.scale, scale) and torch.equal(got.data.view(torch.uint8), data.view(torch.uint8))
        else:  # compiled apart (other warps at head dim 512), the fp32 reductions may round differently
            within_one_step(got, dense, dense)
        want = self.native.attend(q, self.layer, self.kv, self.batch, self.native.prepare(self.batch, self.kv), picks)
        torch.testing.assert_close(dense, want, **TOL[self.dtype])
        within_one_step(got, want, dense)


    def check_store(self) -> None:
        """The KV normalised and turned as the oracle does: the same rounding steps, so only a
        different fp32 sum of squares can move a value (by an ulp of the dtype, in few elements)."""
        kv_new = (torch.randn(self.batch.num_tokens, self.layer.head_dim, device=self.device) * 3).to(self.dtype)
        window_kv = flat(self.kv, self.layer.window_kv)[0]
        window_kv.fill_(float("nan"))
        self.native.store(kv_new, self.layer, self.kv, self.batch, self.native.prepare(self.batch, self.kv))
        want = window_kv.clone()
        window_kv.fill_(float("nan"))
        self.triton.store(kv_new, self.layer, self.kv, self.batch, self.triton.prepare(self.batch, self.kv))
        assert torch.equal(window_kv.isnan(), want.isnan())  # exactly the new tokens' slots written
        written = ~want.isnan()
        got, want = window_kv[written], want[written]
        torch.testing.assert_close(got, want, **TOL[self.dtype])
        if self.dtype != torch.float32:
            assert (got == want).float().mean() > 0.98


def within_one_step(got, want: torch.Tensor, dense: torch.Tensor) -> None:
    """MXFP8 ``got`` against ``want`` quantized by core/native: within one E4M3 step of the coarser
    block scale beyond where ``dense`` (got unquantized) and ``want`` differ, most codes equal."""
    data, scale = quant.quantize_mxfp8(want)
    a, b = got.dequantize().float(), quant.dequantize_mxfp8(data, scale)
    apart = (dense.float() - want.float()).abs()
    assert (a - b).abs().le(e4m3_step(a, b, got.scale, scale) + apart).all()
    assert (got.data.view(torch.uint8) == data.view(torch.uint8)).float().mean() > 0.9


def e4m3_step(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor) -> torch.Tensor:
    """The E4M3 spacing at max(|a|, |b|) under the coarser of the two blocks' scales: 2**-3 of the
    value's power of two, and no finer than the subnormal step, 2**-9 of the scale."""
    coarse = quant.e8m0_to_float(torch.maximum(scale_a, scale_b)).repeat_interleave(32, dim=-1)
    _, exponent = torch.frexp(torch.maximum(a.abs(), b.abs()))
    return torch.maximum(torch.ldexp(torch.ones_like(a), exponent - 4), coarse * 2.0**-9)


@contextmanager
def poisoned_allocations():
    """torch.empty and torch.empty_like hand out memory of 0xFF bytes (NaN in fp32, fp16 and E4M3,
    E8M0's NaN), so an output the kernel leaves unwritten shows."""
    empty, empty_like = torch.empty, torch.empty_like

    def poisoned(make):
        def allocate(*args, **kwargs):
            t = make(*args, **kwargs)
            t.view(-1).view(torch.uint8).fill_(255)
            return t
        return allocate

    torch.empty, torch.empty_like = poisoned(empty), poisoned(empty_like)
    try:
        yield
    finally:
        torch.empty, torch.empty_like = empty, empty_like


def mixed_lens(rng: random.Random, rate: int) -> list[tuple[int, int]]:
    """Decode rows, a prefill from 0, and chunks that start inside a compression window after a
    cached prefix, one of them crossing several windows."""
    inside = rng.randrange(1, 5) * rate + rng.randrange(1, rate)
    return [(rng.randint(1, 90), 1), (0, rng.randint(2, 40)), (inside, rng.randint(2 * rate, 4 * rate)),
            (rng.randint(1, 60), 1), (rng.randrange(2, 6) * rate + 1, rng.randint(1, rate - 1))]


KINDS = {"sliding": dict(rate=0, top_k=0), "hca": dict(rate=8, top_k=0), "csa": dict(rate=4, top_k=8)}


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_attend_interpreted(seed, kind, dtype):
    rng = random.Random(seed)
    k = KINDS[kind]
    lens = mixed_lens(rng, max(k["rate"], 4))
    Case(lens, kind, heads=4, head_dim=32, rope_dim=8, window=rng.choice([8, 16]), rate=k["rate"],
         top_k=k["top_k"], page_size=rng.choice([4, 6, 16]), dtype=dtype).check_attend()


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rate,top_k", [(1, 8), (2, 8), (2, 0)])
def test_attend_csa2_interpreted(seed, dtype, rate, top_k):
    """DeepSeek-V4.1's CSA2 layers with no indexer of their own, over disjoint entries at rate 1 or 2:
    a Reuse layer (``top_k``) attends to the picks its index source made, a group with no index
    source to every visible entry."""
    rng = random.Random(seed)
    Case(mixed_lens(rng, 4), "hca", heads=4, head_dim=32, rope_dim=8, window=rng.choice([8, 16]), rate=rate,
         top_k=top_k, page_size=rng.choice([3, 4]), dtype=dtype).check_attend()


@pytest.mark.interpret
def test_attend_head_blocks_interpreted(seed, monkeypatch):
    """More heads than one program takes (the last block partly masked), a wider rope tail, a window
    longer than a key block, and more picks than a key block."""
    from engine.backends.triton import v4_sparse_attention as sa
    monkeypatch.setitem(sa.SPARSE, "default", sa.SparseTuning({"any": sa.SparseConfig(16, 8, 4, 1)}, 1, 1))
    rng = random.Random(seed)
    Case(mixed_lens(rng, 4), "csa", heads=20, head_dim=64, rope_dim=16, window=24, rate=4, top_k=20, page_size=8,
         dtype=torch.float16).check_attend()


@pytest.mark.interpret
@pytest.mark.parametrize("splits,heads", [(3, 20), (16, 4)])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_attend_splits_interpreted(seed, monkeypatch, kind, splits, heads):
    """Each token's keys cut over several programs and combined by the last to arrive: ranges that
    straddle the window's end, splits past a short list's end, and (CSA, the -1s last) splits
    that hold no entry at all, with one and with two head blocks counting apart; the arrival
    counters are left at zero."""
    from engine.backends.triton import attention_decode
    from engine.backends.triton import v4_sparse_attention as sa
    monkeypatch.setitem(sa.SPARSE, "default", sa.SparseTuning({"any": sa.SparseConfig(16, 4, 4, 1)}, 1 << 20, splits))
    rng = random.Random(seed)
    k = KINDS[kind]
    Case(mixed_lens(rng, max(k["rate"], 4)), kind, heads=heads, head_dim=32, rope_dim=8, window=rng.choice([6, 9]),
         rate=k["rate"], top_k=k["top_k"] + 4, page_size=4, dtype=torch.float32).check_attend(padding_last=True)
    assert not attention_decode.arrival_counters(1, torch.device("cpu")).any()


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_attend_mxfp8_interpreted(seed, monkeypatch, kind, dtype):
    """Two blocks of 32 per head; 20 heads in two head blocks (the last masked) and each token's
    keys split over up to 3 programs, so both the one-program epilogue and the combine's quantize."""
    from engine.backends.triton import v4_sparse_attention as sa
    monkeypatch.setitem(sa.SPARSE, "default", sa.SparseTuning({"any": sa.SparseConfig(16, 8, 4, 1)}, 1 << 20, 3))
    rng = random.Random(seed)
    k = KINDS[kind]
    Case(mixed_lens(rng, max(k["rate"], 4)), kind, heads=20, head_dim=64, rope_dim=16, window=rng.choice([8, 12]),
         rate=k["rate"], top_k=k["top_k"], page_size=rng.choice([4, 8]), dtype=dtype).check_attend_mxfp8()


def test_mxfp8_output_needs_head_dim_of_whole_blocks():
    with pytest.raises(ValueError, match="head_dim 48 is not a multiple"):
        TritonV4Attention(SimpleNamespace(engine_config=SimpleNamespace(mxfp8_attention=True),
                                          model_config=SimpleNamespace(hf={"head_dim": 48})))
    with pytest.raises(ValueError, match="native V4 attention backend does not emit"):
        NativeV4Attention(SimpleNamespace(engine_config=SimpleNamespace(mxfp8_attention=True)))


@pytest.mark.parametrize("caps,asked,emits", [({"mxfp8"}, None, True), ({"fp8", "wgmma"}, None, False),
                                              ({"fp8", "wgmma"}, True, True), ({"mxfp8"}, False, False)])
def test_mxfp8_output_is_on_by_default_where_the_mma_is_native(caps, asked, emits):
    platform = PlatformSpec("nvidia", "sm_x", "a GPU", "cuda", capabilities=frozenset(caps))
    ctx = SelectionContext(platform=platform, model_config=SimpleNamespace(hf={"head_dim": 512}),
                           engine_config=SimpleNamespace(mxfp8_attention=asked))
    assert TritonV4Attention(ctx).emits_mxfp8 is emits
    assert NativeV4Attention(SelectionContext(platform=platform, engine_config=SimpleNamespace(
        mxfp8_attention=None))).emits_mxfp8 is False  # the oracle's output stays unquantized


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kind", ["sliding", "csa"])
def test_store_interpreted(seed, kind, dtype):
    rng = random.Random(seed)
    Case(mixed_lens(rng, 4), kind, heads=2, head_dim=32, rope_dim=8, window=8, rate=4, top_k=4,
         page_size=rng.choice([4, 16]), dtype=dtype).check_store()


@pytest.mark.interpret
def test_prepare_is_per_token(seed):
    rng = random.Random(seed)
    lens = mixed_lens(rng, 4)
    lens.insert(2, (7, 0))  # a sequence that brings no token this step
    case = Case(lens, "sliding", heads=2, head_dim=32, rope_dim=8, window=8, rate=4, top_k=4, page_size=4,
                dtype=torch.float32)
    meta = case.triton.prepare(case.batch, case.kv)
    want_seq = [i for i, (_, n) in enumerate(lens) for _ in range(n)]
    assert meta.token_seq.dtype == torch.int32 and meta.token_seq.tolist() == want_seq
    assert torch.equal(meta.window_slots, case.native.prepare(case.batch, case.kv).window_slots)
    assert meta.max_entries >= max(c + n for c, n in lens)


@pytest.mark.interpret
def test_token_metadata_over_blocks_interpreted(seed):
    """More tokens than a block and more sequences than a step of the kernel's loop (some with no
    token): each token's sequence as searchsorted gives it, its window slot as cache.window_slots."""
    gen = torch.Generator().manual_seed(seed)
    new = torch.randint(0, 5, (100,), generator=gen)  # 200 tokens on average, 128 five deviations below
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), new.cumsum(0)]).to(torch.int32)
    tokens, page_size = int(starts[-1]), 4
    windows = torch.randperm(64, generator=gen).to(torch.int32)
    slots = torch.randint(0, 64 * page_size, (tokens,), generator=gen)
    token_seq, got = token_metadata(starts, slots, windows, page_size)
    assert tokens > 128 and token_seq.dtype == torch.int32 and got.dtype == torch.int64
    want_seq = torch.searchsorted(starts[1:], torch.arange(tokens, dtype=torch.int32), right=True, out_int32=True)
    assert torch.equal(token_seq, want_seq) and torch.equal(got, window_slots(slots, windows, page_size))


def test_csa_without_picks_is_refused(seed):
    case = Case([(3, 2)], "csa", heads=2, head_dim=32, rope_dim=8, window=8, rate=4, top_k=4, page_size=4,
                dtype=torch.float32)
    with pytest.raises(ValueError, match="picks"):
        case.triton.attend(case.queries(), case.layer, case.kv, case.batch, case.triton.prepare(case.batch, case.kv))


@pytest.mark.parametrize("vendor,arch", [("nvidia", "sm_90"), ("amd", "gfx950")])
def test_descriptor_refuses_what_the_kernels_lack(vendor, arch):
    (desc,) = triton_descriptors("v4_attention", vendor)
    assert (desc.family, desc.name) == ("v4_attention", "triton")
    here = PlatformSpec(vendor, arch, "a GPU", "cuda")
    model = lambda head_dim: SimpleNamespace(hf={"head_dim": head_dim})  # noqa: E731
    assert desc.check(SelectionContext(platform=here, model_config=model(512))) == []
    assert desc.check(SelectionContext(platform=here, model_config=model(64))) == []
    (reason,) = desc.check(SelectionContext(platform=here, model_config=model(96)))
    assert "no config for head dim 96" in reason
    v41 = SimpleNamespace(hf={"head_dim": 512, "num_hidden_layers": 4, "compress_ratios": [0, 2, 4, 1, 0]})
    assert desc.check(SelectionContext(platform=here, model_config=v41)) == []  # DeepSeek-V4.1's CSA2 too
    other = PlatformSpec("amd" if vendor == "nvidia" else "nvidia", "gfx942", "another GPU", "cuda")
    assert any("needs" in r for r in desc.check(SelectionContext(platform=other, model_config=model(512))))


FLASH = dict(heads=64, head_dim=512, rope_dim=64, window=128)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("batch", ["decode-1", "decode-32", "mixed"])
def test_attend_flash_shape_gpu(seed, kind, batch):
    """V4-Flash's layer shape in bf16 (CSA 4 picking 512, HCA 128) at long context."""
    rng = random.Random(seed)
    rate, top_k = {"sliding": (4, 0), "hca": (128, 0), "csa": (4, 512)}[kind]
    lens = {"decode-1": [(rng.randint(3000, 8000), 1)],
            "decode-32": [(rng.randint(100, 8000), 1) for _ in range(32)],
            "mixed": [(2000, 1), (0, 700), (1000 + 37, 600), (rng.randint(1, 500), 1)]}[batch]
    Case(lens, kind, rate=rate, top_k=top_k, page_size=64, dtype=torch.bfloat16, device="cuda",
         max_position=16384, **FLASH).check_attend()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_attend_mxfp8_flash_shape_gpu(seed, kind):
    """The MXFP8 epilogue at V4-Flash's layer shape in bf16, decode rows and a prefill beside them."""
    rng = random.Random(seed)
    rate, top_k = {"sliding": (4, 0), "hca": (128, 0), "csa": (4, 512)}[kind]
    lens = [(rng.randint(100, 8000), 1) for _ in range(8)] + [(1000 + 37, 300)]
    Case(lens, kind, rate=rate, top_k=top_k, page_size=64, dtype=torch.bfloat16, device="cuda",
         max_position=16384, **FLASH).check_attend_mxfp8()


@pytest.mark.gpu
def test_store_flash_shape_gpu(seed):
    Case([(100, 1), (0, 300), (37, 90)], "csa", rate=4, top_k=512, page_size=64, dtype=torch.bfloat16,
         device="cuda", max_position=16384, **FLASH).check_store()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["hca", "csa"])
def test_graph_replay_gpu(seed, kind):
    """prepare, store and attend captured once in a CUDA graph and replayed on new positions, keys,
    entries, queries and picks of the same batch size: equal to the eager calls and to native."""
    rng = random.Random(seed)
    rate, top_k = {"hca": (128, 0), "csa": (4, 512)}[kind]
    case = Case([(6000, 1)] * 8, kind, rate=rate, top_k=top_k, page_size=64, dtype=torch.bfloat16, device="cuda",
                max_position=16384, **FLASH)
    captured, kv, layer = case.batch, case.kv, case.layer
    static = dict(q=case.queries(), picks=case.picks(), kv_new=torch.randn(8, 512, device="cuda").to(torch.bfloat16))

    def step(backend, batch):
        meta = backend.prepare(batch, kv)
        backend.store(static["kv_new"], layer, kv, batch, meta)
        return backend.attend(static["q"], layer, kv, batch, meta, static["picks"])

    case.fill()
    step(case.triton, captured)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(case.triton, captured)
    for _ in range(2):
        case.batch = ForwardBatch.build([0] * 8, [1] * 8, [rng.randint(200, 5999) for _ in range(8)], case.tables,
                                        64, [], device="cuda")
        for name in ("positions", "query_start_loc", "seq_lens", "context_lens", "slot_mapping", "page_table"):
            getattr(captured, name).copy_(getattr(case.batch, name))
        case.fill()
        static["q"].copy_(case.queries())
        static["kv_new"].copy_(torch.randn(8, 512, device="cuda"))
        if kind == "csa":
            static["picks"].copy_(case.picks())
        graph.replay()
        got = out.clone()
        torch.testing.assert_close(got, step(case.triton, captured), rtol=0, atol=0)
        torch.testing.assert_close(got, step(case.native, case.batch), **TOL[torch.bfloat16])


@pytest.mark.aot
@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("head_dim,mode,splits,csa2_rate,mxfp8", [
    (64, PICKED.value, 1, 0, False), (512, DENSE.value, 8, 0, False), (512, PICKED.value, 32, 0, False),
    (512, PICKED.value, 32, 1, False), (512, DENSE.value, 8, 2, False), (64, PICKED.value, 1, 0, True),
    (512, PICKED.value, 32, 0, True)])
def test_sparse_attention_compiles(target, head_dim, mode, splits, csa2_rate, mxfp8):
    """bf16 at tiny-dsv4-py's heads (4 of 64, rope 16) and V4-Flash's (64 of 512, rope 64), in one
    program or split with the combine, at V4.1-Flash's CSA2 rates (``csa2_rate``: the picks over
    ratio-1 entries, every pair entry of a group with no indexer), and with the output quantized to
    MXFP8 in the epilogue: the scores and the weighted sum run on the matrix units."""
    from engine.backends.triton.v4_sparse_attention import SPARSE
    cfg = pick(SPARSE, target).per_dim[head_dim]
    pointers = {"q_ptr": "*bf16", "out_ptr": "*fp8e4nv" if mxfp8 else "*bf16", "out_scale_ptr": "*u8",
                "window_ptr": "*bf16", "entries_ptr": "*bf16",
                "picks_ptr": "*i32", "sinks_ptr": "*fp32", "cos_ptr": "*fp32", "sin_ptr": "*fp32",
                "positions_ptr": "*i64", "token_seq_ptr": "*i32", "page_table_ptr": "*i32", "window_table_ptr": "*i32",
                "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "counters_ptr": "*i32"}
    strides = [n for n in sparse_attention_kernel.arg_names if n.startswith("stride_")]
    signature = {**pointers, **{s: "i32" for s in strides}, "qk_scale": "fp32", "window": "i32", "eps": "fp32"}
    heads, rot_half, rate = (64, 32, 4 if mode == PICKED.value else 128) if head_dim == 512 else (4, 8, 16)
    rate = csa2_rate or rate
    constexprs = dict(NUM_HEADS=heads, HEAD_DIM=head_dim, ROT_HALF=rot_half, PAGE_SIZE=64, MODE=mode, RATE=rate,
                      ENTRIES_PER_PAGE=-(-64 // rate), TOP_K=512 if head_dim == 512 else 16, NUM_SPLITS=splits,
                      BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, BLOCK_D=head_dim, MXFP8=mxfp8, PDL=pdl(target))
    asm = compile_asm(sparse_attention_kernel, signature, constexprs, target,
                      num_warps=(mxfp8 and cfg.mxfp8_num_warps) or cfg.num_warps, num_stages=cfg.num_stages,
                      divisible_by_16=strides, sass=mxfp8 and target.startswith("sm_"))
    if target.startswith("sm_"):
        assert f".target {target}a" in asm["ptx"] and "mma" in asm["ptx"]
        if mxfp8:  # the epilogue's quantize stays in registers
            assert local_memory_ops(asm["sass"]) == 0
    else:
        assert target in amdgcn_target(asm["amdgcn"]) and "v_mfma" in asm["amdgcn"]
        if mxfp8:  # the epilogue's quantize in four 64-wide waves: no scratch (8 are sm_90's need)
            scratch, lds = amd_scratch_and_lds(asm)
            assert scratch == 0 and lds <= LDS_BYTES[target]


@pytest.mark.aot
@pytest.mark.parametrize("target", sorted(TARGETS))
def test_store_window_compiles(target):
    """V4-Flash's window KV rows (512 of bf16, rope 64), normalised and turned without a fused
    multiply-add that would skip the oracle's rounding."""
    signature = {"x_ptr": "*bf16", "norm_ptr": "*fp32", "cache_ptr": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32",
                 "positions_ptr": "*i64", "slots_ptr": "*i64", "num_tokens": "i32", "stride_x": "i32",
                 "stride_c": "i32", "stride_cos": "i32", "eps": "fp32"}
    constexprs = dict(HEAD_DIM=512, ROT_HALF=32, BLOCK_T=8, BLOCK_D=512, PDL=pdl(target))
    asm = compile_asm(store_window_kernel, signature, constexprs, target, divisible_by_16=["stride_x", "stride_c"],
                      enable_fp_fusion=False)
    if target.startswith("sm_"):
        assert f".target {target}a" in asm["ptx"] and "fma.rn" not in asm["ptx"]
    else:
        assert target in amdgcn_target(asm["amdgcn"])


@pytest.mark.aot
@pytest.mark.parametrize("target", sorted(TARGETS))
def test_token_metadata_compiles(target):
    signature = {"starts_ptr": "*i32", "slots_ptr": "*i64", "windows_ptr": "*i32", "token_seq_ptr": "*i32",
                 "window_slots_ptr": "*i64", "num_tokens": "i32", "num_seqs": "i32", "page_size": "i32"}
    asm = compile_asm(token_metadata_kernel, signature, dict(BLOCK_T=128, BLOCK_S=64, PDL=pdl(target)), target)
    if target.startswith("sm_"):
        assert f".target {target}a" in asm["ptx"]
    else:
        assert target in amdgcn_target(asm["amdgcn"])
