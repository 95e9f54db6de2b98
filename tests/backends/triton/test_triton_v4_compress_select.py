"""A CSA layer's cache writes and its indexer's top-k in one launch (v4_compress_select.py) against
the two launches it replaces (``store_and_compress``, then ``select``) and the native oracle.

Decode batches of several sequences: one whose entry closes in this very step and that sees fewer
entries than top-k, four that close with more, one inside a window, one that sees none; the index
keys of earlier steps random, every other entry slot NaN, the scores' scratch and the picks poisoned
first. The same programs as the two launches, so their picks to the bit, the counters left at zero.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from aot import GRID_DEPENDENCY, LDS_BYTES, TARGETS, amd_scratch_and_lds, compile_asm, local_memory_ops, pdl
from test_triton_v4_compressor import Case, CountedLaunches, mixed_lens

from engine.backends.triton import v4_compress_select, v4_compressor, v4_indexer
from engine.backends.triton.attention_decode import arrival_counters
from engine.backends.triton.target import pick
from engine.backends.triton.v4_attention import TritonV4Attention
from engine.backends.triton.v4_compress_select import COUNTERS, compress_and_select, compress_select_kernel
from engine.backends.triton.v4_compressor import tiles
from engine.core.families.v4_attention import IndexerLayer, V4AttentionBackend
from engine.core.kv.storage import KVCache
from engine.core.models.deepseek_v4.cache import SeqView, entries_of
from engine.core.native.indexer import quantize_keys
from engine.core.native.v4_attention import NativeV4Attention

RATE, TOP_K, HEADS, INDEX_DIM, ROPE = 4, 4, 3, 32, 16
POISON = {torch.float32: float("nan"), torch.int32: 0x5EED}


@pytest.fixture
def poisoned(monkeypatch):
    """The scores' scratch and the picks start as poison; several splits and top-k blocks a token."""
    empty = lambda shape, dtype, device: torch.full(shape, POISON[dtype], dtype=dtype, device=device)
    monkeypatch.setattr(v4_indexer, "output_buffer", empty)
    monkeypatch.setattr(v4_compress_select, "output_buffer", empty)
    monkeypatch.setitem(v4_indexer.INDEXER, "default",
                        v4_indexer.IndexerConfig(block_n=4, num_warps=1, programs=64, topk_block=4, topk_warps=1))


def decode_lens() -> list[tuple[int, int]]:
    """(cached, 1) rows: one closing its entry with at most TOP_K visible, four closing with more, one
    inside a window with more, and one that sees no entry yet."""
    return ([(RATE * random.randint(1, TOP_K) - 1, 1)] +
            [(RATE * random.randint(TOP_K + 2, 12) - 1, 1) for _ in range(4)] +
            [(RATE * random.randint(TOP_K + 1, 12) + random.randint(0, RATE - 2), 1),
             (random.randint(0, RATE - 2), 1)])


def csa_case(lens, dtype: torch.dtype, fp8: bool, ties: bool = False, stale: bool = False,
             device: str = "cpu") -> Case:
    """A CSA layer with its indexer (HEADS heads of INDEX_DIM, rope on the last ROPE, top TOP_K), the
    index keys of every entry before the step written, and the indexer's queries and weights;
    ``ties``: every other token's weights 0, so each of its scores is 0 and its picks are its lowest
    entries. ``stale``: every earlier key the same, scoring far above any key the step's compression
    makes (queries and weights 1 but on the rope), and the slots of the step's entries holding an
    older key that scores higher still: each row's picks are its lowest entries only where the
    top-k reads the keys the step wrote."""
    case = Case(lens, 32, ROPE, RATE, True, 4, dtype, device, with_indexer=True, fp8=fp8, index_dim=INDEX_DIM)
    case.layer = dataclasses.replace(case.layer, indexer=IndexerLayer(HEADS, INDEX_DIM, TOP_K, case.ix_comp))
    kv = case.cache(case.state)
    keys, scales = entries_of(kv, case.ix_comp.entries)
    level = torch.cat([torch.ones(INDEX_DIM - ROPE, device=device), torch.zeros(ROPE, device=device)])
    for (cached, _), pages in zip(lens, case.tables):
        seq = SeqView(0, cached + 1, 0, torch.tensor(pages, dtype=torch.int32, device=device), kv.window_table(),
                      case.page_size)
        slots = seq.entry_slots(0, (cached + 1) // RATE, RATE)
        earlier = cached // RATE
        plain = 4 * level.expand(slots.shape[0], INDEX_DIM).clone() if stale else torch.randn(slots.shape[0],
                                                                                              INDEX_DIM, device=device)
        plain[earlier:] = 8 * level if stale else float("nan")
        if scales is None:
            keys[slots] = plain.to(keys.dtype)
        else:
            keys[slots[:earlier]], scales[slots[:earlier]] = quantize_keys(plain[:earlier])
    case.state = [t for i in range(kv.num_layers) for t in (kv.layer(i).k, kv.layer(i).v)]
    tokens = case.kv_proj.shape[0]
    case.q = (level.expand(tokens, HEADS, INDEX_DIM) if stale
              else torch.randn(tokens, HEADS, INDEX_DIM, device=device)).to(dtype)
    case.weights = (torch.ones(tokens, HEADS, device=device) if stale
                    else torch.randn(tokens, HEADS, device=device)).to(dtype)
    if ties:
        case.weights[::2] = 0
    return case


def lowest_entries(case: Case) -> torch.Tensor:
    """Each row's lowest min(visible, TOP_K) entries, then -1, sorted."""
    visible = (case.batch.positions + 1) // RATE
    lowest = torch.arange(TOP_K).expand(visible.shape[0], TOP_K)
    return torch.where(lowest < visible[:, None], lowest, -1).to(torch.int32).sort(1).values


def run(case: Case, backend: V4AttentionBackend | None = None) -> tuple[KVCache, torch.Tensor]:
    """The cache after the step and its picks: the one launch, or ``backend``'s two calls."""
    kv = case.cache(case.state)
    args = (case.kv_new, case.kv_proj, case.gate_proj, case.comp, case.layer, kv, case.batch)
    if backend is None:
        return kv, compress_and_select(*args, case.meta(kv), case.indexer_proj, case.q, case.weights)
    meta = backend.prepare(case.batch, kv)
    return kv, V4AttentionBackend.store_compress_and_select(backend, *args, meta, case.indexer_proj, case.q,
                                                            case.weights)


def assert_same_cache(got: KVCache, want: KVCache) -> None:
    for i in range(got.num_layers):
        for a, b in ((got.layer(i).k, want.layer(i).k), (got.layer(i).v, want.layer(i).v)):
            torch.testing.assert_close(a, b, equal_nan=True, rtol=0, atol=0)


@pytest.mark.interpret
@pytest.mark.parametrize("dtype,fp8", [(torch.float32, False), (torch.float16, False), (torch.float16, True)])
@pytest.mark.parametrize("ties", [False, True])
def test_one_launch_equals_the_two_interpreted(seed, poisoned, dtype, fp8, ties):
    """The picks and every cache layer the two launches' to the bit (E4M3 index keys beside FP8
    weights too); every counter back at 0, so a second launch right after picks the same."""
    case = csa_case(decode_lens(), dtype, fp8, ties)
    tokens = case.kv_proj.shape[0]
    kv, picks = run(case)
    want_kv, want = run(case, TritonV4Attention(None))
    assert torch.equal(picks, want)
    assert_same_cache(kv, want_kv)
    assert not arrival_counters(COUNTERS.value + tokens, kv.device)[:COUNTERS.value + tokens].any()
    assert torch.equal(run(case)[1], want)
    visible = (case.batch.positions + 1) // RATE
    assert torch.equal((picks >= 0).sum(1), visible.clamp(max=TOP_K).to(torch.int64))
    if ties:  # a row of equal scores: its lowest entries
        assert torch.equal(picks[::2].sort(1).values, lowest_entries(case)[::2])


@pytest.mark.interpret
def test_the_top_k_reads_the_keys_the_step_wrote_interpreted(seed, poisoned):
    """Where the slots of the step's entries held an older key that outscores every other, the picks
    are each row's lowest entries (equal scores) as the two launches pick: the scores read each
    entry after the launch's compress programs wrote it."""
    case = csa_case(decode_lens(), torch.float32, False, stale=True)
    picks = run(case)[1]
    assert torch.equal(picks.sort(1).values, lowest_entries(case))
    assert torch.equal(picks, run(case, TritonV4Attention(None))[1])


@pytest.mark.interpret
@pytest.mark.parametrize("ties", [False, True])
def test_one_launch_picks_what_the_native_picks_interpreted(seed, poisoned, ties):
    """fp32, against NativeV4Attention's composition of its own store_and_compress and select: the
    same entries (fp32 scores an ulp apart do not reorder random keys)."""
    case = csa_case(decode_lens(), torch.float32, False, ties)
    got, want = run(case)[1], run(case, NativeV4Attention(None))[1]
    assert torch.equal(got.sort(1).values, want.sort(1).values)


@pytest.mark.interpret
@pytest.mark.parametrize("step", ["decode", "prefill"])
def test_backend_launches_once_in_decode_interpreted(seed, poisoned, monkeypatch, step):
    """TritonV4Attention's CSA layer: a decode step in the one launch (no ``index_topk_kernel``), a
    prefill in the two, each picking as the two launches do."""
    launches = {}
    for module, name in ((v4_compress_select, "compress_select_kernel"), (v4_compressor, "compress_kernel"),
                         (v4_indexer, "index_topk_kernel")):
        launches[name] = CountedLaunches(getattr(module, name))
        monkeypatch.setattr(module, name, launches[name])
    case = csa_case(decode_lens() if step == "decode" else mixed_lens(RATE), torch.float32, False)
    backend = TritonV4Attention(None)
    kv = case.cache(case.state)
    got = backend.store_compress_and_select(case.kv_new, case.kv_proj, case.gate_proj, case.comp, case.layer, kv,
                                            case.batch, backend.prepare(case.batch, kv), case.indexer_proj, case.q,
                                            case.weights)
    counts = {name: counted.launches for name, counted in launches.items()}
    one = step == "decode"
    assert counts == {"compress_select_kernel": int(one), "compress_kernel": int(not one),
                      "index_topk_kernel": int(not one)}
    assert torch.equal(got, run(case, backend)[1])


@pytest.mark.interpret
def test_refuses_a_step_past_the_decode_bound(seed, poisoned):
    case = csa_case(mixed_lens(RATE), torch.float32, False)
    with pytest.raises(ValueError, match="run compress and select apart"):
        run(case)


@pytest.mark.interpret
@pytest.mark.parametrize("candidates", ["filtered", "published"])
def test_refuses_an_indexer_with_candidates(seed, poisoned, candidates):
    """The launch scores every visible entry: an indexer taking its top-k inside candidate blocks, or
    publishing them, runs compress and select apart."""
    case = csa_case(decode_lens(), torch.float32, False)
    change = dict(filtered=True, candidate_block_size=2) if candidates == "filtered" else dict(
        candidate_blocks=2, candidate_block_size=2)
    case.layer = dataclasses.replace(case.layer, indexer=dataclasses.replace(case.layer.indexer, **change))
    with pytest.raises(ValueError, match="run compress and select apart"):
        run(case)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_one_launch_equals_the_two_and_replays_gpu(seed, fp8):
    """bf16 on the GPU with the target's own indexer tiles: a decode batch of 8 sequences (the most the
    launch takes; contexts to about 4K, rows closing an entry and rows inside a window) picks and
    writes what the two launches
    do, to the bit; captured in a CUDA graph and replayed over new queries, weights and projections,
    each replay equals the two launches on the same inputs (the counters reset for every replay)."""
    def lens():
        return [(RATE * random.randint(TOP_K + 1, 1000) - random.choice([1, 2]), 1) for _ in range(8)]

    case = csa_case(lens(), torch.bfloat16, fp8, device="cuda")
    kv, picks = run(case)
    want_kv, want = run(case, TritonV4Attention(None))
    assert torch.equal(picks, want)
    assert_same_cache(kv, want_kv)
    kv = case.cache(case.state)
    inputs = [case.q, case.weights, case.kv_proj, case.gate_proj, case.kv_new, *case.indexer_proj]
    args = (case.kv_new, case.kv_proj, case.gate_proj, case.comp, case.layer, kv, case.batch, case.meta(kv),
            case.indexer_proj, case.q, case.weights)
    compress_and_select(*args)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = compress_and_select(*args)
    for _ in range(3):
        fresh = [torch.randn_like(x) for x in inputs]
        for x, y in zip(inputs, fresh):
            x.copy_(y)
        case.restore(kv)
        graph.replay()
        want_kv, want = run(case, TritonV4Attention(None))
        assert torch.equal(captured, want)
        assert_same_cache(kv, want_kv)


@pytest.mark.aot
@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("fp8", [False, True])
def test_one_launch_compiles(target, fp8):
    """V4-Flash's CSA layer in bf16: window KV 512, compressor 512 at rate 4 with overlap, the
    indexer's compressor of 128 (its keys E4M3 or bf16), the indexer's 64 heads x 128 and top-512,
    with the launch's warps: the ticket, the flag's release and acquire and the arrivals at GPU
    scope, the scores on the matrix units, no fused multiply-add, PDL; no spills on NVIDIA, no
    scratch and within the LDS on AMD."""
    cfg = pick(v4_indexer.INDEXER, target)
    compress_cfg = pick(v4_compressor.COMPRESS, target)
    block_d, block_s, warps = tiles(512, 8, compress_cfg)
    ix_block_d, ix_block_s, ix_warps = tiles(128, 8, compress_cfg)
    keys = "*fp8e4nv" if fp8 else "*bf16"
    signature = {
        **{name: "i32" for name in compress_select_kernel.arg_names if name.startswith("stride_")},
        **{p: "*bf16" for p in ("kv_ptr", "gate_ptr", "kv_cache_ptr", "gate_cache_ptr", "entry_ptr", "latent_ptr",
                                "win_ptr", "win_cache_ptr", "sel_q_ptr", "sel_w_ptr")},
        **{f"ix_{p}": "*bf16" for p in ("kv_ptr", "gate_ptr", "kv_cache_ptr", "gate_cache_ptr")},
        **{p: "*fp32" for p in ("entry_scale_ptr", "ape_ptr", "norm_ptr", "cos_ptr", "sin_ptr", "win_norm_ptr",
                                "ix_entry_scale_ptr", "ix_ape_ptr", "ix_norm_ptr", "sel_out_ptr")},
        **{p: "*i32" for p in ("token_seq_ptr", "window_table_ptr", "page_table_ptr", "query_start_ptr", "picks_ptr",
                               "counters_ptr")},
        **{p: "*i64" for p in ("positions_ptr", "window_slots_ptr")},
        **{p: "fp32" for p in ("eps", "win_eps", "ix_eps", "sel_sm_scale", "sel_w_scale")},
        "ix_entry_ptr": keys, "sel_max_entries": "i32", "tokens": "i32"}
    constexprs = dict(
        WIDTH=1024, HEAD_DIM=512, ROPE_HALF=32, RATE=4, OVERLAP=1, NUM_SLOTS=8, PAGE_SIZE=64, ENTRIES_PER_PAGE=16,
        QUANTIZE=False, BLOCK_W=1024, BLOCK_S=block_s, BLOCK_D=block_d, GATED=True, HAS_APE=True, LATENT=False,
        WINDOW=True, WIN_DIM=512, WIN_BLOCK=512, INDEXER=True, IX_WIDTH=256, IX_HEAD_DIM=128, IX_QUANTIZE=fp8,
        IX_BLOCK_W=256, IX_BLOCK_S=ix_block_s, IX_BLOCK_D=ix_block_d,
        SEL_NUM_HEADS=64, SEL_HEAD_DIM=128, SEL_SPLITS=cfg.programs, SEL_HAS_SCALES=fp8, SEL_DOT_FP32=False,
        SEL_BLOCK_H=64, SEL_BLOCK_N=cfg.block_n, SEL_BLOCK_D=128, SEL_TOP_K=512, SEL_TOPK_BLOCK=cfg.topk_block,
        PDL=pdl(target))
    cuda = TARGETS[target].backend == "cuda"
    asm = compile_asm(compress_select_kernel, signature, constexprs, target, num_warps=max(warps, ix_warps,
                                                                                           cfg.num_warps),
                      enable_fp_fusion=False, sass=cuda, **pick(v4_compress_select.OPTIONS, target),
                      divisible_by_16=[n for n in signature if n.startswith("stride_")])
    if cuda:
        ptx = asm["ptx"]
        assert all(op in ptx for op in ("atom.global.gpu.relaxed.add", "atom.global.gpu.acq_rel.add",
                                        "red.global.gpu.release.add", "ld.global.gpu.acquire", *GRID_DEPENDENCY))
        assert ("wgmma" if target == "sm_90" else "tcgen05.mma") in ptx and "fma.rn" not in ptx
        assert local_memory_ops(asm["sass"]) == 0
    else:
        assert "mfma" in asm["amdgcn"] and "global_atomic_add" in asm["amdgcn"]
        scratch, lds = amd_scratch_and_lds(asm)
        assert scratch == 0 and lds <= LDS_BYTES[target]
