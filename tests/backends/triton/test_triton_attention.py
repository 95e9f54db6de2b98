"""Triton paged attention against the native oracle: same pages, same new K/V, same batch.

Batches mix decode sequences, fresh prefills and prefills over a cached prefix, with random
lengths and page lists drawn from the test seed; the pool starts NaN-filled, so a read of a slot
the sequence does not own, or of padding, shows up in the output. Outputs are poisoned before
each run. Both the pages written and the outputs must match.
"""

from __future__ import annotations

import random
import re

import pytest
import torch
import triton

from engine.backends.triton import attention_decode
from engine.backends.triton.attention import TritonAttention
from engine.backends.triton.attention_decode import (DECODE, DecodeTuning, arrival_counters, combine_tile,
                                                     decode_attention, decode_attention_kernel)
from engine.backends.triton.attention_prefill import PREFILL, PrefillConfig, pick_dim, prefill_attention_kernel
from engine.core.families.attention import AttentionLayer, LayerKV
from engine.core.forward import ForwardBatch
from engine.core.native.attention import NativeAttention, attend

TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 2.5e-2}


def make_layer(heads, kv_heads, head_dim, v_head_dim=None, window=None, sinks=False, causal=True, device="cpu"):
    return AttentionLayer(layer_id=0, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                          scale=head_dim**-0.5 * 1.3, v_head_dim=v_head_dim, sliding_window=window,
                          sinks=torch.randn(heads, device=device) * 2 if sinks else None, causal=causal)


def random_lens(decode=2, fresh=1, cached=1, max_ctx=40, max_new=14):
    """(context_len, query_len) pairs in random order: one-token steps, new prompts, prompts over a prefix."""
    lens = ([(random.randint(0, max_ctx), 1) for _ in range(decode)]
            + [(0, random.randint(2, max_new)) for _ in range(fresh)]
            + [(random.randint(1, max_ctx), random.randint(2, max_new)) for _ in range(cached)])
    random.shuffle(lens)
    return lens


class Case:
    """A NaN-filled page pool holding each sequence's cached prefix, plus the step's new q/k/v."""

    def __init__(self, lens, layer, page_size, dtype, device="cpu"):
        self.layer, self.lens, self.dtype = layer, lens, dtype
        dv = layer.v_head_dim or layer.head_dim
        need = [-(-(c + q) // page_size) for c, q in lens]
        num_pages = 1 + sum(need) + 3
        ids = list(range(1, num_pages))
        random.shuffle(ids)
        tables = []
        for n in need:
            tables.append(ids[:n])
            ids = ids[n:]
        shape = (num_pages, page_size, layer.num_kv_heads)
        self.k_pages = torch.full((*shape, layer.head_dim), float("nan"), dtype=dtype, device=device)
        self.v_pages = torch.full((*shape, dv), float("nan"), dtype=dtype, device=device)
        for (c, _), pages in zip(lens, tables):
            slots = torch.tensor([pages[p // page_size] * page_size + p % page_size for p in range(c)],
                                 dtype=torch.long, device=device)
            self.k_pages.view(-1, layer.num_kv_heads, layer.head_dim)[slots] = torch.randn(
                c, layer.num_kv_heads, layer.head_dim, device=device).to(dtype)
            self.v_pages.view(-1, layer.num_kv_heads, dv)[slots] = torch.randn(
                c, layer.num_kv_heads, dv, device=device).to(dtype)
        tokens = sum(q for _, q in lens)
        # q as a slice of a fused qkv projection: its rows are strided, as in a model
        qkv = torch.randn(tokens, layer.num_heads + 1, layer.head_dim, device=device).to(dtype)
        self.q = qkv[:, :layer.num_heads]
        self.k = torch.randn(tokens, layer.num_kv_heads, layer.head_dim, device=device).to(dtype)
        self.v = torch.randn(tokens, layer.num_kv_heads, dv, device=device).to(dtype)
        self.batch = ForwardBatch.build(input_ids=[0] * tokens, query_lens=[q for _, q in lens],
                                        context_lens=[c for c, _ in lens], page_tables=tables,
                                        page_size=page_size, logits_indices=[], device=device)

    def run(self, backend, prepare=True):
        kv = LayerKV(k=self.k_pages.clone(), v=self.v_pages.clone())
        self.batch.attn_metadata = backend.prepare(self.batch) if prepare else None
        if isinstance(backend, TritonAttention):
            poisoned = torch.full((self.q.shape[0], self.layer.num_heads, kv.v.shape[-1]), float("nan"),
                                  dtype=self.dtype, device=self.q.device)
            out = backend.forward(self.q, self.k, self.v, kv, self.layer, self.batch, out=poisoned)
            assert out is poisoned
        else:
            out = backend.forward(self.q, self.k, self.v, kv, self.layer, self.batch)
        return out, kv

    def check(self, prepare=True):
        want, want_kv = self.run(NativeAttention(ctx=None))
        got, got_kv = self.run(TritonAttention(ctx=None), prepare=prepare)
        torch.testing.assert_close(got_kv.k, want_kv.k, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(got_kv.v, want_kv.v, rtol=0, atol=0, equal_nan=True)
        assert got.dtype == self.dtype and not got.isnan().any()
        tol = TOLERANCE[self.dtype]
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


LAYERS = {
    "mha": dict(heads=4, kv_heads=4, head_dim=64),
    "gqa4_window": dict(heads=8, kv_heads=2, head_dim=64, window=7),
    "gqa8_sinks": dict(heads=16, kv_heads=2, head_dim=64, sinks=True),
    "mqa_d128": dict(heads=4, kv_heads=1, head_dim=128),
    "gqa3_vdim": dict(heads=6, kv_heads=2, head_dim=64, v_head_dim=32),
    "window1": dict(heads=4, kv_heads=2, head_dim=64, window=1),
    "bidirectional": dict(heads=4, kv_heads=2, head_dim=64, causal=False),
    "all_d128": dict(heads=8, kv_heads=2, head_dim=128, window=9, sinks=True),
}


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("name", list(LAYERS))
def test_mixed_batch_matches_native(seed, name, dtype):
    Case(random_lens(), make_layer(**LAYERS[name]), page_size=random.choice([4, 16]), dtype=dtype).check()


@pytest.mark.interpret
@pytest.mark.parametrize("page_size", [1, 16, 32])
@pytest.mark.parametrize("kind", ["decode", "prefill", "cached_prefix"])
def test_pure_batches_and_page_sizes(seed, kind, page_size):
    counts = {"decode": dict(decode=4, fresh=0, cached=0), "prefill": dict(decode=0, fresh=3, cached=0),
              "cached_prefix": dict(decode=0, fresh=0, cached=3)}[kind]
    layer = make_layer(heads=8, kv_heads=2, head_dim=64, window=11, sinks=True)
    Case(random_lens(**counts), layer, page_size, torch.float16).check(prepare=kind != "prefill")


@pytest.mark.interpret
@pytest.mark.parametrize("splits", [None, 3], ids=["tuned", "3splits"])
@pytest.mark.parametrize("query_len", [2, 4])
@pytest.mark.parametrize("name", ["gqa4_window", "all_d128", "bidirectional"])
def test_verify_batch_matches_native(seed, monkeypatch, name, query_len, splits):
    """Speculative decoding's verify step: every sequence the same few queries, causal among them,
    across page boundaries, one split and several."""
    if splits:
        _force_splits(monkeypatch, splits)
    lens = [(random.randint(0, 30), query_len) for _ in range(3)]
    case = Case(lens, make_layer(**LAYERS[name]), page_size=4, dtype=torch.float32)
    assert TritonAttention(ctx=None).prepare(case.batch).query_len == query_len
    case.check()


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_head_dim_512(seed, dtype):
    layer = make_layer(heads=4, kv_heads=1, head_dim=512, window=6, sinks=True)
    Case([(random.randint(1, 20), 1), (random.randint(0, 8), random.randint(2, 5))], layer, 16, dtype).check()


def _force_splits(monkeypatch, splits):
    per_dim = DECODE["default"].per_dim
    monkeypatch.setitem(DECODE, "default", DecodeTuning(per_dim, min_programs=1 << 20, max_splits=splits))


@pytest.mark.interpret
@pytest.mark.parametrize("splits", [1, 3, 8, 19])
def test_decode_splits_combine(seed, monkeypatch, splits):
    """Many splits over short sequences leave some empty: they must not count, nor turn the output NaN."""
    _force_splits(monkeypatch, splits)
    assert attention_decode.num_splits_for(DECODE["default"], 3, 2) == splits
    layer = make_layer(heads=8, kv_heads=2, head_dim=64, window=random.choice([None, 5]), sinks=True)
    lens = [(0, 1), (random.randint(1, 6), 1), (random.randint(30, 60), 1)]
    Case(lens, layer, 4, torch.float32).check()


# decode layers for the one-launch combine: GQA groups past one head block (32 > 16), MQA with a
# window and sinks, head dim 512 (its partials combined 2 splits at a time)
DECODE_LAYERS = {
    "gqa2": dict(heads=4, kv_heads=2, head_dim=64),
    "gqa32_blocks": dict(heads=64, kv_heads=2, head_dim=64, sinks=True),
    "mqa_window_sinks": dict(heads=8, kv_heads=1, head_dim=128, window=70, sinks=True),
    "d512_sinks": dict(heads=4, kv_heads=1, head_dim=512, sinks=True),
}


def _counters_at_rest():
    return not arrival_counters(1, torch.device("cpu")).any()


@pytest.mark.interpret
@pytest.mark.parametrize("splits", [1, 4, 19])
@pytest.mark.parametrize("name", list(DECODE_LAYERS))
def test_decode_one_launch_combines(seed, monkeypatch, name, splits):
    """A sequence of one key, one inside a key block, one that fills every split, a longer one and
    one in between: the direct write, partly and fully used splits, and the combine of the last
    program to arrive."""
    _force_splits(monkeypatch, splits)
    layer = make_layer(**DECODE_LAYERS[name])
    block_n = pick_dim(DECODE["default"].per_dim, layer.head_dim).block_n
    lens = [(0, 1), (random.randint(1, block_n - 2), 1), (splits * block_n - 1, 1), (random.randint(600, 700), 1),
            (random.randint(40, 300), 1)]
    random.shuffle(lens)
    Case(lens, layer, 16, torch.float32).check()
    assert _counters_at_rest()


@pytest.mark.interpret
@pytest.mark.parametrize("name", ["gqa32_blocks", "d512_sinks"])
def test_decode_combine_in_small_tiles(seed, monkeypatch, name):
    """Combine tiles smaller than a head block: several head steps, one split per step."""
    _force_splits(monkeypatch, 19)
    monkeypatch.setattr(attention_decode, "COMBINE_TILE", 512)
    layer = make_layer(**DECODE_LAYERS[name])
    assert combine_tile(16, 19, triton.next_power_of_2(layer.head_dim))[1] == 1
    Case([(random.randint(600, 700), 1), (random.randint(300, 500), 1)], layer, 16, torch.float32).check()
    assert _counters_at_rest()


@pytest.mark.interpret
def test_decode_counters_reset_for_the_next_launch(seed, monkeypatch):
    """Two launches in a row over the same buffers, fresh values in them: the second one reads
    counters the first left at zero."""
    _force_splits(monkeypatch, 8)
    layer = make_layer(heads=8, kv_heads=2, head_dim=64, sinks=True)
    case = Case([(random.randint(200, 260), 1) for _ in range(3)], layer, 16, torch.float16)
    for _ in range(2):
        for t in (case.q, case.k, case.v):
            t.copy_(torch.randn(t.shape))
        for pages in (case.k_pages, case.v_pages):
            owned = ~pages.isnan()
            pages[owned] = torch.randn(int(owned.sum())).to(pages.dtype)
        case.check()
        assert _counters_at_rest()


def test_arrival_counters_grow_outside_capture_only(monkeypatch):
    """The buffer grows to a power of two and keeps the old one (captured graphs hold its address);
    growing while a graph is captured is refused before anything is allocated."""
    device = torch.device("cpu")
    monkeypatch.setitem(attention_decode._KEPT_ZERO, (device, torch.int32), [])
    small = arrival_counters(3, device)
    assert small.numel() == 4 and arrival_counters(4, device) is small
    big = arrival_counters(100, device)
    assert big.numel() == 128 and attention_decode._KEPT_ZERO[device, torch.int32] == [small, big]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setitem(attention_decode._KEPT_ZERO, (torch.device("cuda", 0), torch.int32), [])
    with pytest.raises(RuntimeError, match="captured"):
        arrival_counters(8, torch.device("cuda", 0))


@pytest.mark.interpret
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("window", [None, 21, 40])
def test_prefill_key_blocks_inside_and_on_the_edges(seed, monkeypatch, window, causal):
    """Blocks of 16 keys over long-enough sequences: every row block has masked key blocks at the
    window's edge and the causal diagonal, and unmasked ones between them."""
    small = {dim: PrefillConfig(16, 16, 4, 1) for dim in PREFILL["default"]}
    monkeypatch.setitem(PREFILL, "default", small)
    layer = make_layer(heads=4, kv_heads=2, head_dim=64, window=window, sinks=True, causal=causal)
    lens = random_lens(decode=1, fresh=1, cached=2, max_ctx=90, max_new=40)
    Case(lens, layer, random.choice([4, 16]), torch.float32).check()


# real shapes on a GPU, bf16: (heads, kv_heads, head_dim, window, sinks)
GPU_LAYERS = {
    "llama8b": dict(heads=32, kv_heads=8, head_dim=128),
    "qwen3_0.6b": dict(heads=16, kv_heads=8, head_dim=128),
    "gpt_oss": dict(heads=64, kv_heads=8, head_dim=64, window=128, sinks=True),
    "d256_mha": dict(heads=8, kv_heads=8, head_dim=256, window=1024),
    "d512_mqa": dict(heads=16, kv_heads=1, head_dim=512, sinks=True),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_LAYERS))
@pytest.mark.parametrize("batch", [1, 8, 64])
def test_gpu_decode_matches_native(seed, name, batch):
    layer = make_layer(**GPU_LAYERS[name], device="cuda")
    lens = [(random.randint(1, 8191), 1) for _ in range(batch)]
    Case(lens, layer, 16, torch.bfloat16, device="cuda").check()


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_LAYERS))
def test_gpu_prefill_matches_native(seed, name):
    layer = make_layer(**GPU_LAYERS[name], device="cuda")
    lens = random_lens(decode=8, fresh=2, cached=2, max_ctx=4096, max_new=2048)
    Case(lens, layer, random.choice([16, 64]), torch.bfloat16, device="cuda").check()


# the decode kernel at the shapes it is tuned for: Qwen3-0.6B's layer, and MQA at head dim 512
DECODE_GPU_LAYERS = {128: "qwen3_0.6b", 512: "d512_mqa"}


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", list(DECODE_GPU_LAYERS))
@pytest.mark.parametrize("context", [1024, 8192])
@pytest.mark.parametrize("batch", [1, 64])
def test_gpu_decode_real_shapes(seed, batch, context, head_dim):
    """Lengths up to ``context``, the longest at it: at batch 1 most splits of a 1K context are
    empty, at 8K all are used; at batch 64 the grid has few splits."""
    layer = make_layer(**GPU_LAYERS[DECODE_GPU_LAYERS[head_dim]], device="cuda")
    lens = [(context - 1, 1)] + [(random.randint(0, context - 1), 1) for _ in range(batch - 1)]
    Case(lens, layer, 16, torch.bfloat16, device="cuda").check()


def _native_decode(q, kv, layer, table, lens):
    """Each sequence's query over its first ``lens[i]`` keys, through the native ``attend``."""
    page = kv.k.shape[1]
    out = []
    for i, n in enumerate(lens):
        pos = torch.arange(n, device=q.device)
        slots = table[i, pos // page].long() * page + pos % page
        k, v = (t.view(-1, *t.shape[2:])[slots].float().transpose(0, 1) for t in (kv.k, kv.v))  # [Hkv, L, D]
        allowed = pos > n - 1 - layer.sliding_window if layer.sliding_window else torch.ones_like(pos, dtype=bool)
        o = attend(q[i].float().view(layer.num_kv_heads, -1, 1, q.shape[-1]), k, v, allowed, layer)
        out.append(o.reshape(layer.num_heads, -1))
    return torch.stack(out)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", list(DECODE_GPU_LAYERS))
@pytest.mark.parametrize("batch", [1, 64])
@pytest.mark.parametrize("listed", [True, False])
def test_gpu_decode_graph_replays_follow_new_inputs(seed, batch, head_dim, listed):
    """One eager launch (it makes the counters), a captured one, then three replays over new
    queries, keys, values and lengths in the same buffers: each replay combines afresh. The
    sequences listed, or (as a graph's pure decode batch) all of them in order."""
    layer = make_layer(**GPU_LAYERS[DECODE_GPU_LAYERS[head_dim]], device="cuda")
    page, max_len = 16, 8192
    per_seq = max_len // page
    shape = (batch * per_seq + 1, page, layer.num_kv_heads, head_dim)
    kv = LayerKV(k=torch.empty(shape, dtype=torch.bfloat16, device="cuda"), v=torch.empty(shape, dtype=torch.bfloat16,
                                                                                            device="cuda"))
    table = (torch.randperm(batch * per_seq, device="cuda") + 1).view(batch, per_seq).int()
    q = torch.empty(batch, layer.num_heads, head_dim, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(q)
    starts = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    ids = torch.arange(batch, dtype=torch.int32, device="cuda") if listed else None
    seq_lens = torch.empty(batch, dtype=torch.int32, device="cuda")

    def refill():
        lens = [max_len] + [random.randint(1, max_len) for _ in range(batch - 1)]
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        for t in (q, kv.k, kv.v):
            t.normal_()
        out.fill_(float("nan"))
        return lens

    run = lambda: decode_attention(q, kv, layer, out, table, starts, seq_lens, ids)  # noqa: E731
    refill()
    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for _ in range(3):
        lens = refill()
        graph.replay()
        want = _native_decode(q, kv, layer, table, lens)
        assert not out.isnan().any()
        tol = TOLERANCE[torch.bfloat16]
        torch.testing.assert_close(out.float(), want, rtol=tol, atol=tol)


def _pointers(names, dtype):
    return {name: dtype for name in names}


def _ints(names):
    return {name: "i32" for name in names}


STRIDES = ["stride_qt", "stride_qh", "stride_kp", "stride_ks", "stride_kh", "stride_vp", "stride_vs", "stride_vh"]
TABLES = _pointers(["page_table_ptr", "query_start_ptr", "seq_lens_ptr", "seq_ids_ptr"], "*i32")
SHAPE = dict(HEAD_DIM=128, V_HEAD_DIM=128, PAGE_SIZE=16, BLOCK_D=128, BLOCK_DV=128)
# the matrix instruction each kernel's bf16 tl.dot must become: a decode program has only 16 query
# rows, too few for Hopper's wgmma or Blackwell's tcgen05, so it stays on mma.sync there
MFMA_BF16 = r"v_mfma_f32_(16x16|32x32)x\d+_?bf16"
PREFILL_MMA = {"sm_90": r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.bf16\.bf16",
               "sm_100": r"tcgen05\.mma\.cta_group::1\.kind::f16", "gfx942": MFMA_BF16, "gfx950": MFMA_BF16}
DECODE_MMA = {"sm_90": r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32",
              "sm_100": r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32",
              "gfx942": MFMA_BF16, "gfx950": MFMA_BF16}


def _compile_asm(kernel, signature, constexprs, target, cfg) -> dict[str, str]:
    """Strides count as multiples of 16, as the JIT specializes them at a real launch (head dims
    of 64 and up): without that the page gathers cannot be vectorized or made asynchronous. The
    page table's row stride is no such hint: the kernels do not specialize on it."""
    from aot import compile_asm
    strides = [name for name in signature if name.startswith("stride_") and name != "stride_pt"]
    return compile_asm(kernel, signature, constexprs, target, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                       divisible_by_16=strides)


def _compile(kernel, signature, constexprs, target, cfg):
    asm = _compile_asm(kernel, signature, constexprs, target, cfg)
    return asm.get("ptx") or asm["amdgcn"]


def _prefill_signature(dtype: str) -> dict[str, str]:
    return {**_pointers(["q_ptr", "k_ptr", "v_ptr", "out_ptr"], dtype), "sinks_ptr": "*fp32", **TABLES,
            **_ints(STRIDES + ["stride_ot", "stride_oh", "stride_pt"]), "qk_scale": "fp32", "window": "i32"}


# the arrival at a split's counter: one acquire-release add at GPU (agent) scope; on CDNA the L2
# is written back before it and invalidated after it
CDNA_ARRIVAL = r"buffer_wbl2 sc1\s+s_waitcnt vmcnt\(0\)\s+global_atomic_add .*\s+s_waitcnt vmcnt\(0\)\s+buffer_inv sc1"
ARRIVAL = {"sm_90": r"atom\.global\.gpu\.acq_rel\.add", "sm_100": r"atom\.global\.gpu\.acq_rel\.add",
           "gfx942": CDNA_ARRIVAL, "gfx950": CDNA_ARRIVAL}


def _compile_decode(target, cfg, splits, all_decode, query_len=1):
    """The decode kernel at head dim 128, GQA 4, window and sinks; one split has no partials."""
    from aot import pdl
    partials = ({"part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "counters_ptr": "*i32"} if splits > 1
                else {})
    none = {} if splits > 1 else dict(part_out_ptr=None, part_lse_ptr=None, counters_ptr=None)
    block_s = 1 << (splits - 1).bit_length()
    sub_g, chunk_s = combine_tile(4, splits, 128)
    return _compile(
        decode_attention_kernel,
        {**_pointers(["q_ptr", "k_ptr", "v_ptr", "out_ptr"], "*bf16"), "sinks_ptr": "*fp32", **partials, **TABLES,
         **_ints(STRIDES + ["stride_pt", "stride_ot", "stride_oh"]), "qk_scale": "fp32", "window": "i32"},
        dict(NUM_HEADS=32, GROUP=4, NUM_SPLITS=splits, HEAD_BLOCKS=1, BLOCK_H=16, BLOCK_N=cfg.block_n,
             BLOCK_S=block_s, SUB_G=sub_g, CHUNK_S=chunk_s, SLIDING=True, HAS_SINKS=True, ALL_DECODE=all_decode,
             QUERY_LEN=query_len, CAUSAL=True, PDL=pdl(target), **none, **SHAPE), target, cfg)


@pytest.mark.aot
@pytest.mark.parametrize("target", ["sm_90", "sm_100", "gfx942", "gfx950"])
def test_kernels_compile_for_target(target):
    """bf16 at head dim 128, GQA 4, window and sinks: both attention kernels reach the matrix units;
    the decode kernel over 24 splits arrives with one acquire-release atomic, over one split with none."""
    from aot import GRID_DEPENDENCY

    from engine.backends.triton.target import pick

    prefill_cfg = pick_dim(pick(PREFILL, target), 128)
    prefill = _compile(
        prefill_attention_kernel, _prefill_signature("*bf16"),
        dict(GROUP=4, BLOCK_M=prefill_cfg.block_m, BLOCK_N=prefill_cfg.block_n, CAUSAL=True, HAS_SINKS=True,
             SLIDING=True, **SHAPE), target, prefill_cfg)
    decode_cfg = pick_dim(pick(DECODE, target).per_dim, 128)
    # a graph's pure decode batch over 24 splits; a mixed batch's decode rows in one split; a verify
    # graph's 4 queries a sequence
    split, single = _compile_decode(target, decode_cfg, 24, True), _compile_decode(target, decode_cfg, 1, False)
    verify = _compile_decode(target, decode_cfg, 24, True, query_len=4)
    assert re.search(PREFILL_MMA[target], prefill)
    assert all(re.search(DECODE_MMA[target], asm) for asm in (split, single, verify))
    assert len(re.findall(ARRIVAL[target], verify)) == 1
    if target.startswith("sm_"):  # the page gathers are pipelined through shared memory
        assert all("cp.async.cg.shared.global" in asm for asm in (prefill, split, single))
    else:  # 128-bit gathers
        assert all("_dwordx4" in asm for asm in (prefill, split, single))
    assert len(re.findall(ARRIVAL[target], split)) == 1
    assert not re.search(r"\batom\.|global_atomic", single)
    if target.startswith("sm_"):  # the decode kernel starts under the kernel before it (PDL)
        assert all(op in asm for op in GRID_DEPENDENCY for asm in (split, single))
        assert not any(op in prefill for op in GRID_DEPENDENCY)


@pytest.mark.aot
@pytest.mark.parametrize("target", ["sm_90", "sm_100", "gfx942", "gfx950"])
@pytest.mark.parametrize("head_dim", [128, 256])
def test_fp32_prefill_fits_the_shared_memory(target, head_dim):
    """fp32 q/k/v (a model run in float32, at head dims 128 and 256) at the tiles the launch picks fit
    one block's shared memory (LDS on AMD); at bf16's tiles they took 321 and 384 KiB on sm_90, over
    an H100's 227, where such a launch raises OutOfResources."""
    from aot import LDS_BYTES, SHARED_BYTES

    from engine.backends.triton.target import pick

    cfg = pick_dim(pick(PREFILL, target), head_dim).for_itemsize(4)
    asm = _compile_asm(prefill_attention_kernel, _prefill_signature("*fp32"),
                       dict(GROUP=4, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, CAUSAL=True, HAS_SINKS=False,
                            SLIDING=False, HEAD_DIM=head_dim, V_HEAD_DIM=head_dim, PAGE_SIZE=16, BLOCK_D=head_dim,
                            BLOCK_DV=head_dim), target, cfg)
    assert int(asm["shared"]) <= {**SHARED_BYTES, **LDS_BYTES}[target]
