"""The lightning indexer kernel (scores over paged index keys + stable top-k) against the native select,
over keys in the model's dtype and over E4M3 keys with their scales, as the cache keeps either; and
DeepSeek-V4.1's candidate filter (blocks, then the top-k inside them) at CSA2's rates."""

from __future__ import annotations

import dataclasses
import math

import random
from types import SimpleNamespace

import pytest
import torch

from aot import GRID_DEPENDENCY, LDS_BYTES, TARGETS, amd_scratch_and_lds, amdgcn_target, compile_asm, pdl

from engine.backends.triton import v4_indexer
from engine.backends.triton.attention_decode import arrival_counters
from engine.backends.triton.v4_indexer import (block_best_kernel, index_scores_kernel, index_topk, index_topk_kernel,
                                               select, select_candidates, stable_topk_kernel)
from engine.backends.triton.target import pick
from engine.core.families.v4_attention import Compression, IndexerLayer, V4AttentionLayer
from engine.core.forward import ForwardBatch
from engine.core.kv.storage import KVCache, KVLayerSpec
from engine.core.models.deepseek_v4.cache import entries_of, flat, sequences
from engine.core.native.compressor import visible_entries
from engine.core.native.indexer import fp8_index_scores, index_scores, quantize_keys
from engine.core.native.rope import RotaryEmbedding
from engine.core.native.tail_rope import rotate_tail
from engine.core.native.v4_attention import NativeV4Attention

FP8 = torch.float8_e4m3fn
# a batch: a decode row, a prefill from 0, a chunk that starts inside a compression window after a
# cached prefix, and a decode row that sees fewer entries than top_k
LENS = [(37, 1), (0, 23), (18, 9), (6, 1)]


class Case:
    """Sequences (cached prefix, new tokens) on shuffled pages; index keys of every entry up to each
    sequence's end written into a NaN-filled cache, all other slots NaN.

    ``kind``: "random" (normal data), "ties" (small integers, keys from a small pool with a zero
    rope tail, so scores are exact whatever the order of the sums: many equal scores, many exact
    zeros through ReLU), "fp8" (E4M3 keys with amax scales), "fp8-ties" (integer E4M3 keys with
    power-of-two scales: exact too). E4M3 keys live in the cache layer the model gives them, their
    scales in its V.
    """

    def __init__(self, lens, heads, head_dim, rope_dim, top_k, page_size, dtype, device, kind="random",
                 rate=4, max_model_len=None):
        self.rate, self.top_k, self.kind, self.device = rate, top_k, kind, device
        max_model_len = max_model_len or max(c + n for c, n in lens) + 2 * rate + 5
        need = [-(-(c + n) // page_size) for c, n in lens]
        num_pages = sum(need) + 3
        ids = random.sample(range(num_pages), num_pages)
        tables = [ids[sum(need[:i]):sum(need[:i + 1])] for i in range(len(lens))]
        qlens = [n for _, n in lens]
        self.batch = ForwardBatch.build(input_ids=[0] * sum(qlens), query_lens=qlens, context_lens=[c for c, _ in lens],
                                        page_tables=tables, page_size=page_size, logits_indices=[], device=device)
        tokens = sum(qlens)
        fp8 = kind.startswith("fp8")
        key_format = dict(v_head_dim=1, k_dtype=FP8, v_dtype=torch.float32) if fp8 else dict(v_head_dim=0)
        self.kv = KVCache([KVLayerSpec(1, head_dim, rate=rate, **key_format)], num_pages, page_size, dtype, device)
        keys, self.scales = entries_of(self.kv, 0)
        keys.fill_(float("nan"))
        if fp8:
            self.scales.fill_(float("nan"))
            self.plain = torch.full(keys.shape, float("nan"), device=device)  # "fp8": the keys before quantizing
        self.seqs = sequences(self.batch, self.kv.window_table())
        self.dims = (tokens, heads, head_dim, rope_dim, dtype)
        self.q = torch.empty(tokens, heads, head_dim, dtype=dtype, device=device)
        self.weights = torch.empty(tokens, heads, device=device)
        self.fill()
        self.rope = RotaryEmbedding(head_dim, rope_dim, max_model_len, 10000.0, None, is_neox_style=False,
                                    device=device)
        comp = Compression(rate, True, torch.zeros(rate, 2 * head_dim), torch.ones(head_dim), 1e-6, 0, 0)
        self.layer = V4AttentionLayer(heads, head_dim, 8, torch.zeros(heads), self.rope, 0, torch.ones(head_dim),
                                      1e-6, indexer=IndexerLayer(heads, head_dim, top_k, comp))
        token_seq = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(qlens)).to(torch.int32)
        self.meta = SimpleNamespace(token_seq=token_seq.to(device), max_entries=-(-max_model_len // rate))

    @property
    def exact(self) -> bool:
        """Integer data gives exact scores only where head_dim^-0.5 is a power of two (16, 64, 256): at
        128 two keys' equal integer sums may round apart, differently in each order of the sums."""
        return math.log2(self.dims[2]) % 2 == 0

    def fill(self):
        """Fresh queries, weights and keys, in place."""
        tokens, heads, head_dim, rope_dim, dtype = self.dims
        if self.kind.endswith("ties"):
            self.q.copy_(torch.randint(-2, 3, self.q.shape, device=self.device))
            self.weights.copy_(torch.randint(-1, 4, self.weights.shape, device=self.device) * 0.5)
        else:
            self.q.copy_(torch.randn(self.q.shape, device=self.device))
            self.weights.copy_(torch.randn(self.weights.shape, device=self.device) * heads ** -0.5)
        for seq in self.seqs:
            self._write_keys(seq.entry_slots(0, seq.end // self.rate, self.rate), head_dim, rope_dim, dtype)

    def _write_keys(self, slots, head_dim, rope_dim, dtype):
        keys, n = flat(self.kv, 0)[0], slots.shape[0]
        if self.kind == "fp8":
            self.plain[slots] = torch.randn(n, head_dim, device=self.device) * 3
            keys[slots], self.scales[slots] = quantize_keys(self.plain[slots])
            return
        if self.kind.endswith("ties"):
            pool = torch.randint(-2, 3, (3, head_dim), device=self.device).float()
            pool[:, head_dim - rope_dim:] = 0  # rotated query tails meet zeros: exact products
            pool[0] = 0  # every score of this key is 0
            values = pool[torch.randint(0, 3, (n,), device=self.device)]
            if self.kind == "fp8-ties":
                keys[slots] = values.to(FP8)
                self.scales[slots] = 2.0 ** torch.randint(-2, 3, (n,), device=self.device).float()
            else:
                keys[slots] = values.to(dtype)
            return
        keys[slots] = torch.randn(n, head_dim, device=self.device).to(dtype)

    def rotated_q(self) -> torch.Tensor:
        positions = self.batch.positions
        return rotate_tail(self.q, self.rope.cos[positions][:, None], self.rope.sin[positions][:, None])

    def scores(self, plain: bool = False) -> torch.Tensor:
        """[T, max_entries] fp32 reference scores: core/native/indexer.py over each sequence's keys
        (``plain``: over the "fp8" keys before they were quantized), -inf for entries a token does
        not see."""
        positions, q = self.batch.positions, self.rotated_q()
        keys = flat(self.kv, 0)[0]
        out = torch.full((q.shape[0], self.meta.max_entries), float("-inf"), device=self.device)
        for seq in self.seqs:
            n = seq.end // self.rate
            slots = seq.entry_slots(0, n, self.rate)
            rows = slice(seq.start, seq.start + seq.new)
            if plain:
                s = index_scores(q[rows], self.plain[slots], self.weights[rows])
            elif self.scales is None:
                s = index_scores(q[rows], keys[slots], self.weights[rows])
            else:
                s = fp8_index_scores(q[rows], keys[slots], self.scales[slots], self.weights[rows])
            hidden = torch.arange(n, device=self.device) >= visible_entries(positions[rows], self.rate)[:, None]
            out[rows, :n] = s.masked_fill(hidden, float("-inf"))
        return out

    def want(self) -> torch.Tensor:
        """The native choice: NativeV4Attention.select itself, on the keys as the cache keeps them."""
        native = NativeV4Attention(ctx=None)
        return native.select(self.q, self.weights, self.layer, self.kv, self.batch, native.prepare(self.batch, self.kv))

    def run(self) -> torch.Tensor:
        return select(self.q, self.weights, self.layer, self.kv, self.batch, self.meta)

    def check(self, got: torch.Tensor | None = None, rtol: float = 1e-5):
        """Each row's picks as a set against the native one: equal where the data makes every score
        exact; otherwise the same number of distinct visible picks whose reference scores match the
        native picks' scores within ``rtol`` of the row's largest (only near-ties may swap)."""
        got = self.run() if got is None else got
        scores = self.scores()
        want = self.want()
        assert got.shape == want.shape == (self.q.shape[0], self.top_k) and got.dtype == torch.int32
        got_sorted, want_sorted = got.sort(dim=1).values, want.sort(dim=1).values
        if self.kind.endswith("ties") and self.exact:
            assert torch.equal(got_sorted, want_sorted)
            return
        visible = visible_entries(self.batch.positions, self.rate)
        assert torch.equal((got >= 0).sum(1), (want >= 0).sum(1))
        assert ((got < visible[:, None]) & (got >= -1)).all()
        assert ((got_sorted[:, 1:] != got_sorted[:, :-1]) | (got_sorted[:, 1:] < 0)).all(), "an entry picked twice"
        picked = lambda p: scores.gather(1, p.clamp(min=0).long()).masked_fill(p < 0, float("-inf"))
        a, b = picked(got).sort(1).values, picked(want).sort(1).values
        scale = scores.masked_fill(scores.isinf(), 0).abs().amax(1, keepdim=True).clamp(min=1e-6)
        torch.testing.assert_close(a / scale, b / scale, rtol=0, atol=rtol)


POISON = {torch.float32: float("nan"), torch.int32: 0x5EED}  # NaN scores sort above all others


@pytest.fixture
def poisoned_scratch(monkeypatch):
    """The kernels' outputs (the scores, the picks) start as poison: a slot either forgets shows."""
    monkeypatch.setattr(v4_indexer, "output_buffer", lambda shape, dtype, device: torch.full(
        shape, POISON[dtype], dtype=dtype, device=device))


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("page_size", [4, 8, 6])
def test_select_interpreted(seed, poisoned_scratch, dtype, page_size):
    Case(LENS, 4, 32, 16, 4, page_size, dtype, "cpu").check(rtol=1e-5 if dtype == torch.float32 else 1e-3)


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kind", ["ties", "fp8-ties"])
@pytest.mark.parametrize("topk_block", [8, 2])
def test_ties_go_to_the_lowest_entry_interpreted(seed, poisoned_scratch, monkeypatch, dtype, kind, topk_block):
    """Exact scores with many equal ones (duplicate keys, zeros through ReLU, negative weights):
    the picks equal the native stable top-k exactly, also where the scores equal to the threshold
    spread over several blocks of the top-k's passes. Head dim 16 and 16 heads: d^-0.5 = 1/4 and the
    weights' scale heads^-0.5 = 1/4 are exact."""
    monkeypatch.setitem(v4_indexer.INDEXER, "default", v4_indexer.IndexerConfig(
        block_n=16, num_warps=1, programs=8, topk_block=topk_block, topk_warps=1))
    Case(LENS + [(50, 3)], 16, 16, 8, 3, 4, dtype, "cpu", kind=kind).check()


@pytest.mark.interpret
@pytest.mark.parametrize("page_size", [8, 6])
def test_fp8_keys_interpreted(seed, poisoned_scratch, page_size):
    """E4M3 keys with their scales in the cache layer's V: the picks equal the native select's but
    where near-tied scores may swap."""
    Case(LENS, 4, 32, 16, 4, page_size, torch.float16, "cpu", kind="fp8").check(rtol=1e-3)


@pytest.mark.interpret
@pytest.mark.parametrize("rate", [1, 2])
@pytest.mark.parametrize("kind,dtype", [("ties", torch.float32), ("fp8-ties", torch.float16)])
@pytest.mark.parametrize("blocks,size", [(3, 4), (2, 1)])
def test_candidate_filter_interpreted(seed, poisoned_scratch, monkeypatch, rate, kind, dtype, blocks, size):
    """DeepSeek-V4.1's two-level indexer at CSA2's rates, on exact scores with many ties: the candidate
    source's blocks (the best visible score of each, the newest block always, ties to the lowest
    block, -1 past the visible blocks) and the top-k inside them equal the native ones exactly, where
    the blocks hold more entries than top_k (3 of 4) and fewer (2 of 1). 16 heads: their weights'
    scale 16^-0.5 is exact."""
    monkeypatch.setitem(v4_indexer.INDEXER, "default", v4_indexer.IndexerConfig(
        block_n=16, num_warps=1, programs=8, topk_block=8, topk_warps=1))
    case = Case(LENS + [(50, 3)], 16, 16, 8, 3, 4, dtype, "cpu", kind=kind, rate=rate)
    want, want_blocks = check_candidates(case, blocks, size)
    assert (want >= 0).sum() < want.numel() and (want_blocks >= 0).sum() < want_blocks.numel()  # -1 rows shown


def check_candidates(case: Case, blocks: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The case's layer as a candidate source of ``blocks`` blocks of ``size`` entries and as an indexer
    filtered by them (handed its blocks in a random order): the Triton blocks and picks inside them
    equal the native ones as sets; returns the native (picks, blocks)."""
    layer = dataclasses.replace(case.layer, indexer=dataclasses.replace(
        case.layer.indexer, candidate_blocks=blocks, candidate_block_size=size, filtered=True))
    native = NativeV4Attention(None)
    meta = native.prepare(case.batch, case.kv)
    want_blocks = native.select_candidates(case.q, case.weights, layer, case.kv, case.batch, meta)
    got_blocks = select_candidates(case.q, case.weights, layer, case.kv, case.batch, case.meta)
    assert got_blocks.shape == (case.q.shape[0], blocks) and got_blocks.dtype == torch.int32
    assert torch.equal(got_blocks.sort(1).values, want_blocks.sort(1).values)
    want = native.select(case.q, case.weights, layer, case.kv, case.batch, meta, want_blocks)
    shuffled = got_blocks.gather(1, torch.rand(got_blocks.shape, device=got_blocks.device).argsort(1))  # any order
    got = select(case.q, case.weights, layer, case.kv, case.batch, case.meta, shuffled)
    assert torch.equal(got.sort(1).values, want.sort(1).values)
    return want, want_blocks


def test_fp8_scores_stay_within_e4m3_of_the_exact_keys(seed):
    """Scores over E4M3 keys differ from those over the keys before quantizing by no more than E4M3
    allows: each channel off by half a step (2^-4 of it, or 2^-10 of the scale below the normal
    range), through the ReLU (1-Lipschitz) and the weighted head sum; plus fp32's own roundings."""
    case = Case(LENS, 16, 32, 16, 4, 8, torch.float32, "cpu", kind="fp8")
    exact, quantized = case.scores(plain=True), case.scores()
    q, w, d = case.rotated_q().abs(), case.weights.abs(), case.dims[2]
    bound = torch.zeros_like(exact)
    for seq in case.seqs:
        n = seq.end // case.rate
        slots = seq.entry_slots(0, n, case.rate)
        k, scale = case.plain[slots].abs(), case.scales[slots]
        rows = slice(seq.start, seq.start + seq.new)
        step = (2 ** -4 + 2 ** -20) * k + 2 ** -10 * scale[:, None]  # [n, d]: the most each channel moves
        per_head = torch.einsum("thd,nd->thn", q[rows], step) + 1e-5 * torch.einsum("thd,nd->thn", q[rows], k)
        bound[rows, :n] = (w[rows, :, None] * per_head).sum(1) * d ** -0.5
    seen = exact.isfinite()
    assert torch.equal(seen, quantized.isfinite()) and seen.any()
    diff = (quantized - exact)[seen]
    assert (diff.abs() <= bound[seen]).all(), f"worst excess {(diff.abs() - bound[seen]).max():.3g}"
    assert diff.abs().max() > 0  # the keys really were quantized


@pytest.mark.interpret
def test_splits_and_token_chunks_interpreted(seed, poisoned_scratch, monkeypatch):
    """Entry blocks over several programs per token, and a step larger than the scratch taken in
    chunks of tokens; top_k above the number of entries any sequence can have."""
    monkeypatch.setitem(v4_indexer.INDEXER, "default",
                        v4_indexer.IndexerConfig(block_n=4, num_warps=1, programs=64, topk_block=4, topk_warps=1))
    case = Case(LENS, 3, 32, 16, 8, 4, torch.float32, "cpu")
    monkeypatch.setattr(v4_indexer, "SCRATCH_BYTES", 7 * 4 * case.meta.max_entries)
    case.check()
    small = Case([(9, 3), (0, 6)], 2, 32, 16, 16, 4, torch.float32, "cpu", max_model_len=40)
    assert small.meta.max_entries < 16
    small.check()


@pytest.mark.interpret
@pytest.mark.parametrize("kind", ["random", "fp8-ties"])
def test_one_launch_equals_scores_then_topk_interpreted(seed, poisoned_scratch, monkeypatch, kind):
    """The scores and the top-k in one launch (each token's last split to arrive selects) pick what the
    scores' launch followed by the top-k's launch pick, to the bit, entries over several splits and
    top-k blocks; every token's counter is left at 0."""
    monkeypatch.setitem(v4_indexer.INDEXER, "default",
                        v4_indexer.IndexerConfig(block_n=4, num_warps=1, programs=64, topk_block=4, topk_warps=1))
    case = Case(LENS, 3, 32, 16, 4, 4, torch.float32, "cpu", kind=kind)
    keys, scales = entries_of(case.kv, 0)
    args = (case.rope.cos, case.rope.sin, case.batch.positions, case.meta.token_seq, case.batch.page_table, 4, 4)
    got = index_topk(case.q, case.weights, keys, scales, *args, 4, case.meta.max_entries)
    cfg = v4_indexer.INDEXER["default"]
    want = torch.full_like(got, POISON[torch.int32])
    for a, b, scores in v4_indexer._scored(case.q, case.weights, 1.0, keys, scales, *args, case.meta.max_entries,
                                           cfg):
        stable_topk_kernel[(b - a,)](scores, case.batch.positions[a:b], want, want[a:b], case.meta.max_entries,
                                     scores.stride(0), 0, want.stride(0), TOP_K=4, RATE=4, BLOCK=cfg.topk_block,
                                     PDL=False)
    assert torch.equal(got, want)
    assert not arrival_counters(got.shape[0], got.device)[:got.shape[0]].any()


@pytest.mark.interpret
def test_bad_inputs_name_the_field(seed):
    case = Case([(0, 5)], 2, 32, 16, 2, 4, torch.float32, "cpu")
    keys, args = flat(case.kv, 0)[0], (case.rope.cos, case.rope.sin, case.batch.positions, case.meta.token_seq,
                                       case.batch.page_table, 4, 4, 2, case.meta.max_entries)
    with pytest.raises(ValueError, match="weights"):
        index_topk(case.q, case.weights[:, :1], keys, None, *args)
    with pytest.raises(ValueError, match="key_scales"):
        index_topk(case.q, case.weights, keys, torch.ones(keys.shape[0]), *args)
    with pytest.raises(ValueError, match="key_scales"):
        index_topk(case.q, case.weights, keys.to(FP8), None, *args)
    with pytest.raises(ValueError, match="q "):
        select(case.q[:, :1], case.weights, case.layer, case.kv, case.batch, case.meta)


SCORES_SIGNATURE = {"q_ptr": "*bf16", "w_ptr": "*bf16", "keys_ptr": "*bf16", "scales_ptr": "*fp32", "cos_ptr": "*fp32",
                    "sin_ptr": "*fp32", "positions_ptr": "*i64", "token_seq_ptr": "*i32", "page_table_ptr": "*i32",
                    "out_ptr": "*fp32", "cand_ptr": "*i32", "max_entries": "i32", "sm_scale": "fp32", "w_scale": "fp32",
                    **{name: "i32" for name in index_scores_kernel.arg_names if name.startswith("stride_")}}


def _compile(target: str, key_dtype: str, fp32: bool = False, filtered: bool = False):
    q = "fp32" if fp32 else "bf16"
    signature = {**SCORES_SIGNATURE, "q_ptr": f"*{q}", "w_ptr": f"*{q}", "keys_ptr": f"*{key_dtype}"}
    # filtered: V4.1-Flash's Reindex layers, inside 2048 candidate blocks of 8 entries at rate 1
    constexprs = dict(NUM_HEADS=64, HEAD_DIM=128, ROT_HALF=32, RATE=1 if filtered else 4, PAGE_SIZE=64, SPLITS=4,
                      HAS_SCALES=key_dtype == "fp8e4nv", DOT_FP32=fp32, BLOCK_H=64, BLOCK_N=64, BLOCK_D=128,
                      PDL=pdl(target), NUM_CAND=2048 if filtered else 0, CAND_SIZE=8 if filtered else 1)
    return compile_asm(index_scores_kernel, signature, constexprs, target, enable_fp_fusion=False)


@pytest.mark.aot
@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("key_dtype", ["bf16", "fp8e4nv"])
@pytest.mark.parametrize("filtered", [False, True])
def test_index_scores_compiles(target, key_dtype, filtered):
    """The V4-Flash indexer (64 heads x 128, rope 64, rate 4) with bf16 and E4M3 keys, and V4.1-Flash's
    scoring inside candidate blocks: the heads x entries product runs on the matrix units (wgmma on
    sm_90, tcgen05 on sm_100, MFMA on AMD)."""
    asm = _compile(target, key_dtype, filtered=filtered)
    if target.startswith("sm_"):
        assert all(op in asm["ptx"] for op in GRID_DEPENDENCY)
    if target == "sm_90":
        assert "wgmma" in asm["ptx"]
    elif target == "sm_100":
        assert "tcgen05.mma" in asm["ptx"] or "wgmma" in asm["ptx"] or "mma.sync" in asm["ptx"]
    else:
        assert target in amdgcn_target(asm["amdgcn"])
        assert "mfma" in asm["amdgcn"]
        scratch, lds = amd_scratch_and_lds(asm)
        assert scratch == 0 and lds <= LDS_BYTES[target]


TOPK_SIGNATURE = {"scores_ptr": "*fp32", "positions_ptr": "*i64", "cand_ptr": "*i32", "out_ptr": "*i32",
                  "max_entries": "i32", "stride_s": "i32", "stride_c": "i32", "stride_o": "i32"}


@pytest.mark.aot
@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("stage", ["top-512", "candidate-blocks", "inside-candidates"])
def test_stable_topk_compiles(target, stage):
    """The top-512 select over a token's scores, as launched on the GPU; and V4.1-Flash's candidate
    filter (rate 1): the 2048 best blocks of 8 entries, then the top-512 inside them."""
    constexprs = {"top-512": dict(TOP_K=512, RATE=4),
                  "candidate-blocks": dict(TOP_K=2048, RATE=1, GROUP=8),
                  "inside-candidates": dict(TOP_K=512, RATE=1, NUM_CAND=2048, CAND_SIZE=8)}[stage]
    constexprs = dict(dict(GROUP=1, NUM_CAND=0, CAND_SIZE=1), **constexprs, BLOCK=1024, PDL=pdl(target))
    asm = compile_asm(stable_topk_kernel, TOPK_SIGNATURE, constexprs, target)
    if target.startswith("sm_"):
        assert f".target {target}a" in asm["ptx"]
        assert all(op in asm["ptx"] for op in GRID_DEPENDENCY)
    else:
        assert target in amdgcn_target(asm["amdgcn"])
        scratch, lds = amd_scratch_and_lds(asm)
        assert scratch == 0 and lds <= LDS_BYTES[target]


@pytest.mark.aot
@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("key_dtype", ["bf16", "fp8e4nv"])
def test_index_topk_compiles(target, key_dtype):
    """The V4-Flash indexer's scores and top-512 in one launch, with the scoring's tiles and warps as
    launched: its MMA, the tokens' GPU-scope acq_rel arrival, PDL; no spills on sm_90, no scratch and
    within the LDS on AMD."""
    from aot import local_memory_ops

    cfg = pick(v4_indexer.INDEXER, target)
    signature = {**SCORES_SIGNATURE, "keys_ptr": f"*{key_dtype}",
                 "picks_ptr": "*i32", "counters_ptr": "*i32", "stride_picks": "i32"}
    constexprs = dict(NUM_HEADS=64, HEAD_DIM=128, ROT_HALF=32, RATE=4, PAGE_SIZE=64, SPLITS=4,
                      HAS_SCALES=key_dtype == "fp8e4nv", DOT_FP32=False, BLOCK_H=64, BLOCK_N=cfg.block_n,
                      BLOCK_D=128, PDL=pdl(target), TOP_K=512, TOPK_BLOCK=cfg.topk_block, NUM_CAND=0, CAND_SIZE=1)
    asm = compile_asm(index_topk_kernel, signature, constexprs, target, num_warps=cfg.num_warps,
                      enable_fp_fusion=False, sass=target == "sm_90")
    if target.startswith("sm_"):
        assert "atom.global.gpu.acq_rel.add" in asm["ptx"] and all(op in asm["ptx"] for op in GRID_DEPENDENCY)
        assert ("wgmma" if target == "sm_90" else "tcgen05.mma") in asm["ptx"]
        if target == "sm_90":
            assert local_memory_ops(asm["sass"]) == 0
    else:
        assert "mfma" in asm["amdgcn"] and "global_atomic_add" in asm["amdgcn"]
        scratch, lds = amd_scratch_and_lds(asm)
        assert scratch == 0 and lds <= LDS_BYTES[target]


@pytest.mark.aot
@pytest.mark.parametrize("target", sorted(TARGETS))
def test_block_best_compiles(target):
    """The candidate filter's block maxima at V4.1-Flash's blocks of 8 entries."""
    signature = {"scores_ptr": "*fp32", "positions_ptr": "*i64", "out_ptr": "*fp32", "max_entries": "i32",
                 "stride_s": "i32", "stride_o": "i32"}
    asm = compile_asm(block_best_kernel, signature, dict(RATE=1, SIZE=8, BLOCK_B=128, BLOCK_E=8, PDL=pdl(target)),
                      target, divisible_by_16=["stride_s"])
    if target.startswith("sm_"):
        assert all(op in asm["ptx"] for op in GRID_DEPENDENCY)
    else:
        assert target in amdgcn_target(asm["amdgcn"])


@pytest.mark.aot
def test_fp32_scores_compile_without_tf32():
    """fp32 queries take the IEEE path: no TF32 MMA that would round the products."""
    assert "tf32" not in _compile("sm_90", "fp32", fp32=True)["ptx"]


# --- on the GPU: the DeepSeek-V4-Flash indexer (64 heads x 128, rope 64, top-512, rate 4) ---

FLASH = dict(heads=64, head_dim=128, rope_dim=64, top_k=512, page_size=64)


def _flash(lens, kind, max_model_len):
    return Case(lens, FLASH["heads"], FLASH["head_dim"], FLASH["rope_dim"], FLASH["top_k"], FLASH["page_size"],
                torch.bfloat16, "cuda", kind=kind, max_model_len=max_model_len)


def _flash_lens(batch: str, context: int):
    return {"decode-1": [(context - 1, 1)],
            "decode-64": [(random.randint(1, context - 1), 1) for _ in range(64)],
            "prefill": [(0, min(context, 4096))],
            "mixed": [(context - 300, 300), (random.randint(1, context - 1), 1), (0, 700), (1023, 1)]}[batch]


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["random", "ties", "fp8", "fp8-ties"])
@pytest.mark.parametrize("context", [1024, 16384])
@pytest.mark.parametrize("batch", ["decode-1", "decode-64", "prefill", "mixed"])
def test_select_flash_gpu(seed, poisoned_scratch, kind, context, batch):
    _flash(_flash_lens(batch, context), kind, 16384 + 64).check(rtol=1e-5 if kind == "random" else 2e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("rate", [1, 2])
@pytest.mark.parametrize("kind", ["ties", "fp8-ties"])
@pytest.mark.parametrize("batch", ["decode-64", "mixed"])
def test_candidate_filter_flash_gpu(seed, poisoned_scratch, rate, kind, batch):
    """V4.1-Flash's candidate filter (blocks of 8, top-512 inside them) on exact tied scores at 32K
    tokens: 64 heads of 64 (V4.1-Flash's are 128, where integer scores are not exact), as many blocks
    as a fourth of those a token sees at most (2048 at rate 1)."""
    case = Case(_flash_lens(batch, 32768), 64, 64, 32, 512, 64, torch.bfloat16, "cuda", kind=kind, rate=rate,
                max_model_len=32768 + 64)
    check_candidates(case, 2048 // rate, 8)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["random", "fp8"])
def test_select_graph_replay_gpu(seed, kind):
    """Captured once, replayed on new queries, weights and keys: equal to eager on those contents."""
    case = _flash(_flash_lens("mixed", 16384), kind, 16384 + 64)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        case.run()  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = case.run()
    for _ in range(2):
        case.fill()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.sort(1).values, case.run().sort(1).values)
        case.check(out.clone(), rtol=1e-5 if kind == "random" else 2e-3)
