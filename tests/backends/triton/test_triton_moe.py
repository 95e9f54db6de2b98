"""Fused MoE on Triton against core/native/moe.py.

The alignment is checked for its invariants; the grouped GEMMs stage by stage (poisoned outputs,
every row must be written) and end to end through ``TritonMoE.experts`` against
``NativeMoE.experts``, with routings built to leave experts empty and to put experts' row counts
on, just below and just above the BLOCK_M boundaries. The FP8 path is tested on weights made by
``quantize_fp8_block`` per expert, against the native experts on the dequantized weights (the gap
is E4M3's rounding of the activations). FP4 experts (``quantize_fp4``, DeepSeek-V4's format) run
against the native experts on the same packed weights: dequantized in registers to the gap of
summation order; through ``tl.dot_scaled`` stage by stage on the same MXFP8 activations, and end to
end to the gap of the activations' MXFP8 rounding.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from engine.backends.triton.fused_moe import _moe_gemm_kernel, arrivals_for, fused_moe, moe_down, moe_gate_up
from engine.backends.triton.moe_tiles import (FP4_PTX_UNPACK, FP4_SCALED_MMA, MOE_FP4_GEMM, MOE_GEMM, MOE_TUNING,
                                              moe_config, ptx_unpack_fits, stages_within)
from engine.backends.triton.moe import TritonMoE
from engine.backends.triton.fp8_gemm import GemmConfig
from engine.backends.triton.moe_align import (ALIGN, ExpertBlocks, _align_one_chunk_kernel, _count_kernel,
                                              _place_kernel, _scan_kernel, align_by_expert, max_padded_rows)
from engine.backends.triton.moe_one_launch import arrival_counts, moe_one_launch
from engine.backends.triton.target import pick
from engine.core.families.moe import ExpertWeights
from engine.core.native import quant
from engine.core.native.moe import NativeMoE, _swiglu

FP8 = torch.float8_e4m3fn
DEFAULT = pick(MOE_GEMM, "default")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def random_ids(num_tokens: int, num_experts: int, top_k: int, device="cpu") -> torch.Tensor:
    """Distinct experts per token, as top-k routing chooses them."""
    return torch.rand(num_tokens, num_experts, device=device).argsort(dim=1)[:, :top_k]


def ids_with_counts(counts: list[int], top_k: int) -> torch.Tensor:
    """A routing in which expert e gets ``counts[e]`` tokens (each at most once per token): the
    experts listed count times fill the [top_k, T] grid row by row, then tokens and slots are
    shuffled."""
    num_tokens = sum(counts) // top_k
    assert sum(counts) == num_tokens * top_k and max(counts) <= num_tokens
    listed = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    ids = listed.view(top_k, num_tokens).T[torch.randperm(num_tokens)]
    return ids.gather(1, torch.rand(num_tokens, top_k).argsort(dim=1))


def random_experts(num_experts, hidden, inner, dtype, device="cpu", swiglu_limit=None) -> ExpertWeights:
    gate_up = torch.randn(num_experts, 2 * inner, hidden, device=device) * hidden**-0.5
    down = torch.randn(num_experts, hidden, inner, device=device) * inner**-0.5
    return ExpertWeights(gate_up.to(dtype), down.to(dtype), swiglu_limit=swiglu_limit)


def routing_weights(num_tokens, top_k, device="cpu") -> torch.Tensor:
    w = torch.rand(num_tokens, top_k, device=device) + 0.1
    return w / w.sum(dim=1, keepdim=True)


def activations(num_tokens, hidden, dtype, device="cpu", scale=1.0) -> torch.Tensor:
    return (torch.randn(num_tokens, hidden, device=device) * scale).to(dtype)


def check_experts(x, weights, ids, w, bound):
    out = torch.full_like(x, float("nan"))
    got = TritonMoE(None).experts(x, weights, ids, w, out=out)
    ref = NativeMoE(None).experts(x, weights, ids, w)
    assert got.data_ptr() == out.data_ptr() and got.dtype == ref.dtype and got.shape == ref.shape
    assert not got.isnan().any()
    assert rel_err(got, ref) < bound


# alignment


def check_alignment(ids: torch.Tensor, num_experts: int, block_m: int) -> None:
    blocks = align_by_expert(ids, num_experts, block_m)
    flat = ids.reshape(-1).cpu()
    n = flat.numel()
    sorted_ids, block_expert = blocks.sorted_ids.cpu(), blocks.block_expert.cpu()
    counts = torch.bincount(flat[flat >= 0], minlength=num_experts)  # -1: no expert
    used = int(((counts + block_m - 1) // block_m * block_m).sum())
    assert sorted_ids.dtype == block_expert.dtype == blocks.num_padded.dtype == torch.int32
    assert sorted_ids.numel() == max_padded_rows(n, num_experts, block_m) == block_expert.numel() * block_m
    assert int(blocks.num_padded) == used and blocks.num_assignments == n
    assert (sorted_ids[used:] == n).all() and (block_expert[used // block_m:] == -1).all()
    live = sorted_ids[:used]
    assert torch.equal(live[live < n].sort().values, (flat >= 0).nonzero().squeeze(1).to(torch.int32))
    per_block = live.view(-1, block_m)
    experts = block_expert[:used // block_m]
    assert (experts[1:] > experts[:-1]).sum() == max(int((counts > 0).sum()) - 1, 0)  # contiguous, ascending
    assert torch.equal(torch.bincount(experts.long(), minlength=num_experts), (counts + block_m - 1) // block_m)
    for block, expert in zip(per_block, experts.tolist()):
        rows = block[block < n].long()
        assert rows.numel() > 0 and (flat[rows] == expert).all()
        assert (block[:rows.numel()] == block[block < n]).all()  # padding only after the rows
    for expert in range(num_experts):
        rows = live[(live < n) & (block_expert.repeat_interleave(block_m)[:used] == expert)]
        assert (rows[1:] > rows[:-1]).all()  # stable: assignment order inside an expert


@pytest.mark.interpret
@pytest.mark.parametrize("num_tokens,num_experts,top_k", [(1, 8, 1), (5, 8, 2), (40, 16, 4), (3, 256, 8),
                                                         (300, 256, 6), (97, 64, 8), (16, 8, 2), (17, 8, 2)])
@pytest.mark.parametrize("block_m", [16, 64])
def test_alignment_invariants(seed, num_tokens, num_experts, top_k, block_m):
    check_alignment(random_ids(num_tokens, num_experts, top_k), num_experts, block_m)


@pytest.mark.interpret
@pytest.mark.parametrize("counts,top_k", [([16, 17, 15, 0, 1, 32, 0, 7], 2), ([16, 16, 16, 16, 0, 0, 0, 0], 2),
                                          ([64, 0, 0, 0, 0, 0, 0, 0], 1)])
def test_alignment_at_block_boundaries(seed, counts, top_k):
    check_alignment(ids_with_counts(counts, top_k), len(counts), 16)


@pytest.mark.interpret
@pytest.mark.parametrize("num_tokens", [5, 40])  # one chunk of assignments, and several
def test_alignment_of_column_slices(seed, num_tokens):
    """The routed columns and the shared one of a wider routing align in place (their row stride)
    exactly as their contiguous copies do."""
    num_experts, top_k = 16, 3
    wide = torch.cat([random_ids(num_tokens, num_experts, top_k), torch.zeros(num_tokens, 1, dtype=torch.long)], 1)
    for ids in (wide[:, :top_k], wide[:, top_k:]):
        assert not ids.is_contiguous()
        got, want = align_by_expert(ids, num_experts, 16), align_by_expert(ids.contiguous(), num_experts, 16)
        assert torch.equal(got.sorted_ids, want.sorted_ids) and torch.equal(got.block_expert, want.block_expert)
        assert torch.equal(got.num_padded, want.num_padded) and got.num_assignments == want.num_assignments
        check_alignment(ids, num_experts, 16)


def without_experts(ids: torch.Tensor) -> torch.Tensor:
    """``ids`` with about a third of the rows, and a few single entries, -1 (no expert), as an
    expert-parallel exchange's padding rows are."""
    ids = ids.clone()
    ids[torch.rand(ids.shape[0]) < 1 / 3] = -1
    ids.view(-1)[torch.randint(ids.numel(), (ids.numel() // 8,))] = -1
    return ids


@pytest.mark.interpret
@pytest.mark.parametrize("num_tokens,top_k", [(9, 1), (5, 4), (96, 1), (40, 3)])  # one chunk of assignments, several
@pytest.mark.parametrize("block_m", [16, 64])
def test_alignment_places_no_row_for_no_expert(seed, num_tokens, top_k, block_m):
    """An id -1 is counted for no expert and placed in no block: the padded rows are those of the
    real assignments alone."""
    check_alignment(without_experts(random_ids(num_tokens, 8, top_k)), 8, block_m)
    check_alignment(torch.full((num_tokens, top_k), -1), 8, block_m)


@pytest.mark.interpret
def test_alignment_of_no_tokens():
    blocks = align_by_expert(torch.zeros(0, 4, dtype=torch.long), 8, 16)
    assert blocks.num_blocks == 0 and int(blocks.num_padded) == 0


# grouped GEMMs in the interpreter


def assignment_reference(x, ids, w: ExpertWeights, weights):
    """Per assignment (token t's k-th expert e): SwiGLU of x[t] @ gate_up[e].T; and per token the sum
    over k of that through down[e] times the routing weight, each GEMM rounded to x's dtype as
    F.linear does."""
    token = torch.arange(ids.numel()) // ids.shape[1]
    expert = ids.reshape(-1)
    gu = torch.einsum("ah,aoh->ao", x[token].float(), w.gate_up[expert].float()).to(x.dtype)
    h = _swiglu(gu, w)
    y = torch.einsum("ai,ahi->ah", h.float(), w.down[expert].float()).to(x.dtype)
    return h, combined(y, weights)


def combined(rows, weights):
    """[T * top_k, H] rows weighted by [T, top_k] and summed per token, in fp32."""
    return (rows.float().view(*weights.shape, -1) * weights[..., None].float()).sum(dim=1)


def poisoned_arrivals(num_tokens, hidden, cfg):
    """Arrival counts as an allocation may leave them: the gate/up GEMM must clear them."""
    return arrivals_for(num_tokens, hidden, cfg, torch.device("cpu")).random_(-2**31, 2**31 - 1)


@pytest.mark.interpret
@pytest.mark.parametrize("which", ["small", "large"])
@pytest.mark.parametrize("dtype,bound", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
def test_gate_up_and_down_stages_write_every_row(seed, which, dtype, bound):
    num_tokens, num_experts, top_k, hidden, inner = (5, 16, 2, 64, 80) if which == "small" else (24, 8, 4, 96, 64)
    cfg = getattr(DEFAULT, which)
    assert moe_config(num_tokens, top_k, num_experts, torch.device("cpu")) == cfg
    x = activations(num_tokens, hidden, dtype)
    ids = random_ids(num_tokens, num_experts, top_k)
    weights = routing_weights(num_tokens, top_k)
    w = random_experts(num_experts, hidden, inner, dtype, swiglu_limit=1.0)
    ref_h, ref_y = assignment_reference(x, ids, w, weights)
    blocks = align_by_expert(ids, num_experts, cfg.block_m)
    arrivals = poisoned_arrivals(num_tokens, hidden, cfg)
    h = moe_gate_up(x, blocks, w.gate_up, top_k, cfg, arrivals=arrivals, swiglu_limit=w.swiglu_limit,
                    out=torch.full((ids.numel(), inner), float("nan"), dtype=dtype))
    assert not h.isnan().any() and rel_err(h, ref_h) < bound
    assert (arrivals == 0).all()
    y = moe_down(ref_h, blocks, w.down, weights, ids, cfg, arrivals=arrivals,
                 out=torch.full((num_tokens, hidden), float("nan"), dtype=dtype))
    assert not y.isnan().any() and rel_err(y, ref_y) < bound
    assert (arrivals == top_k).all()  # each token's rows of each column tile counted once


@pytest.mark.interpret
@pytest.mark.parametrize("num_tokens,num_experts,top_k,hidden,inner,limit", [
    (1, 8, 2, 64, 64, None),     # decode config, 6 experts without tokens
    (3, 16, 4, 128, 96, 1.0),    # most experts empty; the clamp bites at this limit
    (40, 8, 4, 64, 128, None),   # prefill config, several blocks per expert
    (17, 12, 3, 96, 256, 0.5),
])
@pytest.mark.parametrize("dtype,bound", [(torch.float32, 1e-5), (torch.float16, 3e-3)])
def test_experts_match_native(seed, num_tokens, num_experts, top_k, hidden, inner, limit, dtype, bound):
    x = activations(num_tokens, hidden, dtype, scale=2.0)
    w = random_experts(num_experts, hidden, inner, dtype, swiglu_limit=limit)
    check_experts(x, routing_weights(num_tokens, top_k), random_ids(num_tokens, num_experts, top_k), w, bound)


def rows_of_each_kind(num_tokens: int, num_experts: int, top_k: int, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Expert ids [T, top_k] whose rows are, drawn at random with at least one of each, of kind 0: every
    id real; 1: every id -1 (an exchange's padding row); 2: mixed, 1 to top_k - 1 of them -1 (a token
    whose other experts are on other ranks). The ids and each row's kind."""
    ids = random_ids(num_tokens, num_experts, top_k)
    kind = torch.randint(3, (num_tokens,))
    kind[torch.randperm(num_tokens)[:3]] = torch.arange(3)
    masked = torch.rand(num_tokens, top_k).argsort(dim=1) < torch.randint(1, top_k, (num_tokens, 1))
    ids[(kind == 2)[:, None] & masked] = -1
    ids[kind == 1] = -1
    return ids.to(device), kind.to(device)


def with_counters(blocks: ExpertBlocks, num_tokens: int, hidden: int, cfg: GemmConfig) -> ExpertBlocks:
    """``blocks`` with the counters of the experts' one launch, zeroed as the dispatch launch zeroes them."""
    words = blocks.num_blocks + 1 + arrival_counts(num_tokens, hidden, cfg)
    return dataclasses.replace(blocks, counters=torch.zeros(words, dtype=torch.int32, device=blocks.sorted_ids.device))


@pytest.mark.interpret
@pytest.mark.parametrize("num_tokens,top_k", [(5, 2), (9, 3), (40, 4)])  # decode and prefill tiles; 1 or 5 chunks
def test_ids_of_no_expert_add_nothing(seed, poisoned_empty, num_tokens, top_k):
    """Rows of all three kinds in one batch, the -1 pairs with weights of their own (not 0): a row with
    a real id gets native's sum over its real pairs, a row of -1 ids is not written (out keeps what it
    held, which accumulating 0 leaves too); the rows the -1 pairs would have are never read (poisoned)."""
    ids, kind = rows_of_each_kind(num_tokens, 8, top_k)
    x, weights, w = activations(num_tokens, 64, torch.float32), routing_weights(num_tokens, top_k), \
        random_experts(8, 64, 64, torch.float32, swiglu_limit=1.0)
    want, prior = NativeMoE(None).experts(x, weights, ids, w), activations(num_tokens, 64, torch.float32)
    assert not want[kind == 1].any()
    got = TritonMoE(None).experts(x, weights, ids, w, out=prior.clone())
    assert torch.equal(got[kind == 1], prior[kind == 1])
    assert not got.isnan().any() and rel_err(got[kind != 1], want[kind != 1]) < 1e-5
    added = fused_moe(x, weights, ids, w.gate_up, w.down, swiglu_limit=w.swiglu_limit, out=prior.clone(),
                      accumulate=True)
    assert rel_err(added, prior + want) < 1e-5 and torch.equal(added[kind == 1], prior[kind == 1])


@pytest.mark.interpret
@pytest.mark.parametrize("which,counts,top_k", [
    ("small", [16, 0, 15, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], 2),
    ("large", [32, 33, 31, 0, 1, 24, 0, 39], 4),
])
def test_experts_at_block_boundaries(seed, which, counts, top_k):
    """Experts with exactly BLOCK_M rows, one more, one fewer, one row and none."""
    assert getattr(DEFAULT, which).block_m in counts
    ids = ids_with_counts(counts, top_k)
    num_tokens = ids.shape[0]
    assert moe_config(num_tokens, top_k, len(counts), torch.device("cpu")) == getattr(DEFAULT, which)
    x = activations(num_tokens, 64, torch.float32)
    check_experts(x, routing_weights(num_tokens, top_k), ids, random_experts(len(counts), 64, 64, torch.float32), 1e-5)


def fp8_block_of(m: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 and fp32 block scales: 128-blocks as DeepSeek-V3's (amax / 448), 32-blocks as DeepSeek-V4.1
    stores them (powers of two, E8M0) and its loader keeps them (as fp32)."""
    if block == 128:
        return quant.quantize_fp8_block(m.float())
    data, exponents = quant.quantize_fp8_block_e8m0(m.float(), block)
    return data, quant.e8m0_to_float(exponents)


def fp8_experts(w: ExpertWeights, block: int = 128):
    """Each expert's matrices quantized in ``block`` x ``block`` blocks, and the weights they stand for."""
    def per_expert(stack):
        data, scale = zip(*(fp8_block_of(m, block) for m in stack))
        return torch.stack(data), torch.stack(scale)
    (gu, gu_scale), (dn, dn_scale) = per_expert(w.gate_up), per_expert(w.down)
    dequantized = ExpertWeights(
        torch.stack([quant.dequantize_fp8_block(d, s, block, w.gate_up.dtype) for d, s in zip(gu, gu_scale)]),
        torch.stack([quant.dequantize_fp8_block(d, s, block, w.down.dtype) for d, s in zip(dn, dn_scale)]),
        swiglu_limit=w.swiglu_limit)
    return (gu, gu_scale, dn, dn_scale), dequantized


def check_fp8(x, weights, ids, w, bound, block=128, config=None):
    (gu, gu_scale, dn, dn_scale), dequantized = fp8_experts(w, block)
    out = torch.full_like(x, float("nan"))
    got = fused_moe(x, weights, ids, gu, dn, swiglu_limit=w.swiglu_limit, gate_up_scale=gu_scale,
                    down_scale=dn_scale, out=out, config=config)
    ref = NativeMoE(None).experts(x, weights, ids, dequantized)
    assert not got.isnan().any() and rel_err(got, ref) < bound


@pytest.mark.interpret
@pytest.mark.parametrize("num_tokens,num_experts,top_k,hidden,inner,limit,dtype,block", [
    (2, 8, 2, 256, 192, None, torch.float32, 128),  # I = 192: a 128-row scale block holds gate and up rows
    (20, 8, 4, 128, 256, 1.0, torch.float16, 128),
    (2, 8, 2, 160, 96, None, torch.float32, 32),  # DeepSeek-V4.1's 32-blocks, H = 160: five K steps
    (20, 8, 4, 96, 64, 1.0, torch.float16, 32),
])
def test_fp8_experts_match_native_on_dequantized_weights(seed, num_tokens, num_experts, top_k, hidden, inner,
                                                          limit, dtype, block):
    """Through the two grouped GEMMs (activations quantized per token and ``block`` channels by a
    launch before each) and through ``TritonMoE.experts``, native on the same stored weights."""
    x = activations(num_tokens, hidden, dtype, scale=2.0)
    w = random_experts(num_experts, hidden, inner, dtype, swiglu_limit=limit)
    weights, ids = routing_weights(num_tokens, top_k), random_ids(num_tokens, num_experts, top_k)
    check_fp8(x, weights, ids, w, 0.06, block)
    check_experts(x, weights, ids, stack_in("fp8_block", w, block), 0.06)



# the tiles MOE_GEMM gives sm_90 and sm_100 (those the AOT test compiles without spills), each once
GPU_TILES = list(dict.fromkeys(getattr(pick(MOE_GEMM, target), which)
                               for target in ("sm_90", "sm_100") for which in ("small", "large")))


@pytest.mark.interpret
@pytest.mark.parametrize("config", GPU_TILES, ids=lambda c: f"{c.block_m}x{c.block_n}x{c.block_k}")
@pytest.mark.parametrize("scheme", ["dense", "fp8_block"])
def test_gpu_tiles_match_native(seed, config, scheme):
    """The NVIDIA tiles of bf16 and 128-block FP8 experts (a decode tile's FP8 activations quantized
    in the GEMM, as launched) in the interpreter against native: two K steps of the prefill tile's
    64, a K tail in the decode tile's 128 (the down GEMM's 96)."""
    num_tokens, num_experts, top_k, hidden, inner = 24, 4, 2, 128, 96
    x = activations(num_tokens, hidden, torch.float16, scale=2.0)
    w = random_experts(num_experts, hidden, inner, torch.float16, swiglu_limit=1.0)
    weights, ids = routing_weights(num_tokens, top_k), random_ids(num_tokens, num_experts, top_k)
    if scheme == "fp8_block":
        check_fp8(x, weights, ids, w, 0.06, config=config)
    else:
        out = torch.full_like(x, float("nan"))
        got = fused_moe(x, weights, ids, w.gate_up, w.down, swiglu_limit=w.swiglu_limit, out=out, config=config)
        assert not got.isnan().any() and rel_err(got, NativeMoE(None).experts(x, weights, ids, w)) < 3e-3


@pytest.mark.interpret
@pytest.mark.parametrize("num_tokens", [1, 3, 13])  # one row (a [1, k] slice is contiguous), a few, chunked
def test_experts_read_routing_slices_in_place(seed, num_tokens):
    """DeepSeek-V4's unfolded shared expert: one routing [T, top_k + 1] sliced into the routed columns
    and the shared one, each slice through its own stack, gives to the bit what contiguous copies
    give, and what native gives."""
    num_experts, top_k, hidden, inner = 8, 3, 64, 64
    x = activations(num_tokens, hidden, torch.float32, scale=2.0)
    weights = torch.cat([routing_weights(num_tokens, top_k), torch.ones(num_tokens, 1)], 1)
    ids = torch.cat([random_ids(num_tokens, num_experts, top_k), torch.zeros(num_tokens, 1, dtype=torch.long)], 1)
    stacks = random_experts(num_experts, hidden, inner, torch.float32), random_experts(1, hidden, inner, torch.float32)
    for cols, w in zip((slice(0, top_k), slice(top_k, None)), stacks):
        got = TritonMoE(None).experts(x, weights[:, cols], ids[:, cols], w)
        copies = weights[:, cols].contiguous(), ids[:, cols].contiguous()
        assert torch.equal(got, TritonMoE(None).experts(x, *copies, w))
        check_experts(x, weights[:, cols], ids[:, cols], w, 1e-5)


def stack_in(scheme: str, w: ExpertWeights, block: int = 128) -> ExpertWeights:
    """``w`` kept as ``scheme`` (FP8 in ``block``-blocks), as ``ExpertStack.keep_quantized`` holds a
    checkpoint's experts."""
    if scheme == "fp8_block":
        (gu, gu_scale, dn, dn_scale), _ = fp8_experts(w, block)
        return ExpertWeights(gu, dn, swiglu_limit=w.swiglu_limit, scheme=scheme, gate_up_scale=gu_scale,
                             down_scale=dn_scale)
    return fp4_experts(w) if scheme == "fp4" else w


@pytest.mark.interpret
# FP8: E4M3 roundings of x and of the SwiGLU output, which native does not make (over 25 seeds a
# relative error of 0.055 median, 0.077 at most)
@pytest.mark.parametrize("scheme,dtype,bound", [("dense", torch.float16, 3e-3), ("fp8_block", torch.float32, 0.1),
                                                ("fp4", torch.float32, 1e-5)])
@pytest.mark.parametrize("num_tokens,top_k,shared", [(1, 1, True), (1, 3, False), (21, 1, False), (21, 3, True)])
def test_combine_in_the_down_gemm(seed, scheme, dtype, bound, num_tokens, top_k, shared):
    """The down GEMM's combine against native in each weight format: one token and many, one expert
    a token and several, with and without DeepSeek-V4's folded shared expert (the routing's last
    column, weight 1, naming the stack's last expert, which every token takes)."""
    num_experts, hidden, inner = 6, 128, 128
    x = activations(num_tokens, hidden, dtype, scale=2.0)
    weights, ids = routing_weights(num_tokens, top_k), random_ids(num_tokens, num_experts, top_k)
    if shared:
        weights = torch.cat([weights, torch.ones(num_tokens, 1)], 1)
        ids = torch.cat([ids, torch.full((num_tokens, 1), num_experts)], 1)
    w = random_experts(num_experts + shared, hidden, inner, torch.float32, swiglu_limit=1.0)
    w = stack_in(scheme, ExpertWeights(w.gate_up.to(dtype), w.down.to(dtype), swiglu_limit=1.0))
    check_experts(x, weights, ids, w, bound)


@pytest.mark.interpret
def test_refuses_unknown_activation_and_fp8_without_scales():
    x, weights, ids = torch.zeros(2, 128), torch.ones(2, 2), torch.zeros(2, 2, dtype=torch.long)
    w = random_experts(4, 128, 128, torch.float32)
    with pytest.raises(ValueError, match="not supported"):
        TritonMoE(None).experts(x, weights, ids, ExpertWeights(w.gate_up, w.down, activation="gelu"))
    with pytest.raises(ValueError, match="scales"):
        fused_moe(x, weights, ids, w.gate_up.to(FP8), w.down.to(FP8))
    with pytest.raises(ValueError, match="do not fit"):
        fused_moe(x, weights, ids, w.gate_up, w.down[:, :64])
    with pytest.raises(ValueError, match="do not fit"):
        fused_moe(x, weights[:, :1], ids, w.gate_up, w.down)


def fp4_experts(w: ExpertWeights) -> ExpertWeights:
    (gu, gu_scale), (dn, dn_scale) = quant.quantize_fp4(w.gate_up.float()), quant.quantize_fp4(w.down.float())
    return ExpertWeights(gu, dn, swiglu_limit=w.swiglu_limit, scheme="fp4", gate_up_scale=gu_scale,
                         down_scale=dn_scale)


def check_fp4(x, weights, ids, w: ExpertWeights, scaled_mma: bool, bound: float, config=None):
    out = torch.full_like(x, float("nan"))
    got = fused_moe(x, weights, ids, w.gate_up, w.down, swiglu_limit=w.swiglu_limit, gate_up_scale=w.gate_up_scale,
                    down_scale=w.down_scale, out=out, scaled_mma=scaled_mma, config=config)
    ref = NativeMoE(None).experts(x, weights, ids, w)
    assert got.data_ptr() == out.data_ptr() and not got.isnan().any()
    assert rel_err(got, ref) < bound


@pytest.mark.interpret
@pytest.mark.parametrize("num_tokens,num_experts,top_k,hidden,inner,limit", [
    (1, 8, 2, 64, 64, None),     # decode config
    (3, 16, 4, 96, 160, 1.0),    # K tails inside a BLOCK_K step; the clamp bites
    (40, 8, 4, 128, 96, 0.5),    # prefill config, several blocks per expert
])
@pytest.mark.parametrize("dtype,bound", [(torch.float32, 1e-5), (torch.float16, 3e-3)])
def test_fp4_experts_dequantized_in_registers_match_native(seed, num_tokens, num_experts, top_k, hidden, inner, limit,
                                                           dtype, bound):
    x = activations(num_tokens, hidden, dtype, scale=2.0)
    w = fp4_experts(random_experts(num_experts, hidden, inner, torch.float32, swiglu_limit=limit))
    check_fp4(x, routing_weights(num_tokens, top_k), random_ids(num_tokens, num_experts, top_k), w, False, bound)


@pytest.mark.interpret
@pytest.mark.parametrize("num_tokens,num_experts,top_k,hidden,inner", [(2, 8, 2, 64, 96), (30, 4, 2, 160, 64)])
def test_fp4_scaled_mma_stages_match_dequantized(seed, num_tokens, num_experts, top_k, hidden, inner):
    """tl.dot_scaled on MXFP8 activations and FP4 weights: each stage equals the products of what
    the operands stand for (the interpreter scales and upcasts, as sm_90 would)."""
    cfg = DEFAULT.for_m(num_tokens * top_k // num_experts)
    w32 = random_experts(num_experts, hidden, inner, torch.float32, swiglu_limit=1.0)
    w = fp4_experts(w32)
    dequantized = ExpertWeights(quant.dequantize_fp4(w.gate_up, w.gate_up_scale),
                                quant.dequantize_fp4(w.down, w.down_scale), swiglu_limit=1.0)
    x, ids, weights = activations(num_tokens, hidden, torch.float32), random_ids(num_tokens, num_experts, top_k), \
        routing_weights(num_tokens, top_k)
    blocks = align_by_expert(ids, num_experts, cfg.block_m)
    a, a_scale = quant.quantize_mxfp8(x)
    ref_h, _ = assignment_reference(quant.dequantize_mxfp8(a, a_scale), ids, dequantized, weights)
    arrivals = poisoned_arrivals(num_tokens, hidden, cfg)
    h = moe_gate_up(a, blocks, w.gate_up, top_k, cfg, arrivals=arrivals, swiglu_limit=1.0, x_scale=a_scale,
                    gate_up_scale=w.gate_up_scale, out_dtype=torch.float32,
                    out=torch.full((ids.numel(), inner), float("nan")))
    assert not h.isnan().any() and rel_err(h, ref_h) < 1e-5
    hq, h_scale = quant.quantize_mxfp8(ref_h)
    ref_y = torch.einsum("ai,ahi->ah", quant.dequantize_mxfp8(hq, h_scale), dequantized.down[ids.reshape(-1)])
    y = moe_down(hq, blocks, w.down, weights, ids, cfg, arrivals=arrivals, h_scale=h_scale,
                 down_scale=w.down_scale, out_dtype=torch.float32, out=torch.full((num_tokens, hidden), float("nan")))
    assert not y.isnan().any() and rel_err(y, combined(ref_y, weights)) < 1e-5


@pytest.mark.interpret
def test_fp4_scaled_mma_end_to_end(seed):
    x = activations(12, 128, torch.float16, scale=2.0)
    w = fp4_experts(random_experts(8, 128, 64, torch.float32, swiglu_limit=1.0))
    # two MXFP8 roundings of the activations: over 40 seeds rel. error median 0.066, max 0.076 (one run saw 0.081)
    check_fp4(x, routing_weights(12, 2), random_ids(12, 8, 2), w, True, 0.1)


@pytest.mark.interpret
def test_triton_moe_runs_fp4_expert_weights(seed):
    x = activations(6, 64, torch.float32)
    w = fp4_experts(random_experts(8, 64, 64, torch.float32))
    check_experts(x, routing_weights(6, 2), random_ids(6, 8, 2), w, 1e-5)


# GPU: bf16 and FP8 at real expert shapes

QWEN3_30B_A3B = dict(num_experts=128, top_k=8, hidden=2048, inner=768, limit=None)
DEEPSEEK_V4_FLASH = dict(num_experts=256, top_k=6, hidden=4096, inner=2048, limit=10.0)
GPU_TOKENS = [1, 3, 16, 128, 1024, 4096]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [QWEN3_30B_A3B, DEEPSEEK_V4_FLASH], ids=["qwen3-30b-a3b", "deepseek-v4-flash"])
@pytest.mark.parametrize("num_tokens", GPU_TOKENS)
def test_experts_bf16_gpu(seed, shape, num_tokens):
    e, k = shape["num_experts"], shape["top_k"]
    x = activations(num_tokens, shape["hidden"], torch.bfloat16, "cuda", scale=2.0)
    w = random_experts(e, shape["hidden"], shape["inner"], torch.bfloat16, "cuda", shape["limit"])
    check_experts(x, routing_weights(num_tokens, k, "cuda"), random_ids(num_tokens, e, k, "cuda"), w, 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 1024])
def test_experts_fp32_gpu(seed, num_tokens):
    """fp32 experts (an fp32 engine's): the large tile's pipeline stages are cut to fit shared memory."""
    shape = dict(DEEPSEEK_V4_FLASH, num_experts=16, hidden=1024, inner=512)
    e, k = shape["num_experts"], shape["top_k"]
    x = activations(num_tokens, shape["hidden"], torch.float32, "cuda")
    w = random_experts(e, shape["hidden"], shape["inner"], torch.float32, "cuda", shape["limit"])
    check_experts(x, routing_weights(num_tokens, k, "cuda"), random_ids(num_tokens, e, k, "cuda"), w, 5e-3)  # TF32 products


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 128, 4096])
def test_experts_fp8_gpu(seed, num_tokens):
    """DeepSeek-V4-Flash expert shapes with a quarter of the experts, to keep three copies small."""
    shape = dict(DEEPSEEK_V4_FLASH, num_experts=64)
    e, k = shape["num_experts"], shape["top_k"]
    x = activations(num_tokens, shape["hidden"], torch.bfloat16, "cuda", scale=2.0)
    w = random_experts(e, shape["hidden"], shape["inner"], torch.bfloat16, "cuda", shape["limit"])
    check_fp8(x, routing_weights(num_tokens, k, "cuda"), random_ids(num_tokens, e, k, "cuda"), w, 0.06)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [GemmConfig(16, 64, 128, 1, 4, 3), GemmConfig(64, 128, 64, 8, 4, 3),
                                    GemmConfig(32, 128, 128, 8, 8, 3), GemmConfig(64, 64, 64, 8, 4, 3)],
                         ids=lambda c: f"{c.block_m}x{c.block_n}x{c.block_k}w{c.num_warps}")
def test_fp4_experts_right_at_any_tile_gpu(seed, config):
    """Tiles that give a thread 32 or 64 bytes of packed weights (the PTX unpack read them wrong on an
    H100: relative error 1.6) beside one of 16: each config right in the dequantize-in-registers path."""
    shape = dict(DEEPSEEK_V4_FLASH, num_experts=16)
    e, k = shape["num_experts"], shape["top_k"]
    x = activations(64, shape["hidden"], torch.bfloat16, "cuda", scale=2.0)
    w = fp4_experts(random_experts(e, shape["hidden"], shape["inner"], torch.float32, "cuda", shape["limit"]))
    check_fp4(x, routing_weights(64, k, "cuda"), random_ids(64, e, k, "cuda"), w, False, 1e-2, config)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 16, 128, 4096])
def test_experts_fp4_gpu(seed, num_tokens):
    """DeepSeek-V4-Flash expert shapes, a quarter of the experts, in the target's FP4 path (dequantized
    in registers on sm_90 / gfx942, MXFP8 activations and tl.dot_scaled on sm_100 / gfx950)."""
    from engine.backends.triton.target import arch_of

    shape = dict(DEEPSEEK_V4_FLASH, num_experts=64)
    e, k = shape["num_experts"], shape["top_k"]
    x = activations(num_tokens, shape["hidden"], torch.bfloat16, "cuda", scale=2.0)
    w = fp4_experts(random_experts(e, shape["hidden"], shape["inner"], torch.float32, "cuda", shape["limit"]))
    scaled = pick(FP4_SCALED_MMA, arch_of(torch.device("cuda")))
    check_fp4(x, routing_weights(num_tokens, k, "cuda"), random_ids(num_tokens, e, k, "cuda"), w, scaled,
              0.08 if scaled else 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 128, 4096])
def test_combine_is_deterministic_gpu(seed, num_tokens):
    """Which program of the down GEMM sums a token's rows changes from run to run; the sum must not:
    repeated runs agree to the bit (a row read before its program stored it would show here too)."""
    shape = dict(DEEPSEEK_V4_FLASH, num_experts=64)
    e, k = shape["num_experts"], shape["top_k"]
    x = activations(num_tokens, shape["hidden"], torch.bfloat16, "cuda", scale=2.0)
    w = random_experts(e, shape["hidden"], shape["inner"], torch.bfloat16, "cuda", shape["limit"])
    weights, ids = routing_weights(num_tokens, k, "cuda"), random_ids(num_tokens, e, k, "cuda")
    first = TritonMoE(None).experts(x, weights, ids, w)
    assert all(torch.equal(TritonMoE(None).experts(x, weights, ids, w), first) for _ in range(20))


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [3, 16, 128, 4096])
def test_ids_of_no_expert_gpu(seed, num_tokens):
    """DeepSeek-V4-Flash expert shapes (a quarter of the experts) in bf16, rows of each kind
    (``rows_of_each_kind``): through the two grouped GEMMs a row with a real id within bf16's bound of
    native, a row of -1 ids left as out held it; at decode sizes the one launch equal to that to the bit."""
    shape = dict(DEEPSEEK_V4_FLASH, num_experts=64)
    e, k, hidden = shape["num_experts"], shape["top_k"], shape["hidden"]
    ids, kind = rows_of_each_kind(num_tokens, e, k, "cuda")
    x, prior = activations(num_tokens, hidden, torch.bfloat16, "cuda", scale=2.0), \
        activations(num_tokens, hidden, torch.bfloat16, "cuda")
    w = random_experts(e, hidden, shape["inner"], torch.bfloat16, "cuda", shape["limit"])
    weights = routing_weights(num_tokens, k, "cuda")
    got = TritonMoE(None).experts(x, weights, ids, w, out=prior.clone())
    want = NativeMoE(None).experts(x, weights, ids, w)
    assert torch.equal(got[kind == 1], prior[kind == 1]) and rel_err(got[kind != 1], want[kind != 1]) < 1e-2
    if num_tokens <= 64:
        cfg = moe_config(num_tokens, k, e, x.device)
        blocks = with_counters(align_by_expert(ids, e, cfg.block_m), num_tokens, hidden, cfg)
        one = moe_one_launch(x, blocks, w.gate_up, w.down, weights, ids, cfg, prior.clone(),
                             swiglu_limit=w.swiglu_limit, gate_up_scale=None, down_scale=None)
        assert torch.equal(one, got)


# ahead-of-time compilation

SIGNATURE = {"a_scale_ptr": "*fp32", "b_scale_ptr": "*fp32", "topk_weight_ptr": "*fp32", "topk_id_ptr": "*i64",
             "arrivals_ptr": "*i32",
             "out_ptr": "*bf16", "sorted_ids_ptr": "*i32", "block_expert_ptr": "*i32", "num_padded_ptr": "*i32",
             **{name: "i32" for name in ["M", "N", "K", "num_assignments", "rows_per_a", "top_k", "tiles", "stride_am",
                                         "stride_as", "stride_be", "stride_bn", "stride_bse", "stride_bsn",
                                         "stride_cm", "stride_om", "stride_wt", "stride_it"]},
             "swiglu_limit": "fp32"}
# the matrix instruction the bf16 dot must become: decode blocks of 16 rows are too few for
# Hopper's wgmma and Blackwell's tcgen05, so they stay on mma.sync there
BF16_MMA = {
    ("sm_90", "large"): r"wgmma\.mma_async\S*\.f32\.bf16\.bf16", ("sm_90", "small"): r"mma\.sync\S*\.bf16\.bf16",
    ("sm_100", "large"): r"tcgen05\.mma", ("sm_100", "small"): r"mma\.sync\S*\.bf16\.bf16",
    ("gfx942", "large"): r"v_mfma_f32_\w+_bf16", ("gfx942", "small"): r"v_mfma_f32_\w+_bf16",
    ("gfx950", "large"): r"v_mfma_f32_\w+_bf16", ("gfx950", "small"): r"v_mfma_f32_\w+_bf16",
}
# gfx942's FP8 is the FNUZ variant, not OCP E4M3: there the operands are widened to fp16 first
FP8_MMA = {"sm_90": r"wgmma\.mma_async\S*\.f32\.e4m3\.e4m3", "sm_100": r"tcgen05\.mma\S*kind::f8f6f4",
           "gfx942": r"v_mfma_f32_\w+_f16", "gfx950": r"v_mfma_f32_\w+_f8f6f4"}
# K steps of 32 take gfx950's E4M3 MFMA of K 16 (its f8f6f4 one spans K 64)
FP8_32_MMA = {**FP8_MMA, "gfx950": r"v_mfma_f32_\w+_fp8_fp8"}


def compile_moe_gemm(target: str, which: str, gated: bool, fp8: bool, block: int = 128,
                     sass: bool = False, dtype: str = "bf16", num_stages: int | None = None) -> dict[str, str]:
    """As fused_moe launches it at DeepSeek-V4-Flash's expert shape (hidden 4096, intermediate 2048:
    K a multiple of every K step), FP8 experts in ``block``-blocks from that edge's table; a decode
    tile of FP8 experts quantizes its activations as it loads them where ``quantizes_in_gemm`` says
    it does (K steps of one block). Unquantized experts and the model in ``dtype``; ``num_stages``
    overrides the table's."""
    from aot import compile_asm, pdl

    cfg = getattr(pick(MOE_TUNING[block], target), which)
    quantize = fp8 and which == "small" and cfg.block_k == block
    operand = "*fp8e4nv" if fp8 else f"*{dtype}"
    signature = {**SIGNATURE, "a_ptr": f"*{dtype}" if quantize else operand, "b_ptr": operand, "c_ptr": f"*{dtype}",
                 "out_ptr": f"*{dtype}"}
    constexprs = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                      GATED=gated, HAS_LIMIT=gated, FP8=fp8, SCALE_BLOCK=block,
                      PDL=pdl(target), FP4=False, SCALED_MMA=False, EVEN_K=True, PTX_UNPACK=False,
                      QUANTIZE_A=quantize, ACCUMULATE=False)
    return compile_asm(_moe_gemm_kernel, signature, constexprs, target, num_warps=cfg.num_warps,
                       num_stages=num_stages or cfg.num_stages,
                       divisible_by_16=["K", "stride_am", "stride_bn", "stride_cm", "stride_om"], sass=sass)


def check_compiled(asm: dict[str, str], target: str, mma: str) -> None:
    text = asm.get("ptx") or asm["amdgcn"]
    assert re.search(mma, text), f"no {mma} in the {target} assembly"


@pytest.mark.aot
@pytest.mark.parametrize("target", ["sm_90", "sm_100", "gfx942", "gfx950"])
@pytest.mark.parametrize("which,gated", [("small", True), ("large", True), ("large", False)],
                         ids=["gate_up-small", "gate_up-large", "down-large"])
def test_bf16_moe_gemm_reaches_the_matrix_units(target, which, gated):
    check_compiled(compile_moe_gemm(target, which, gated, fp8=False), target, BF16_MMA[target, which])


@pytest.mark.aot
@pytest.mark.parametrize("target", ["sm_90", "sm_100", "gfx942", "gfx950"])
def test_fp8_moe_gemm_reaches_the_matrix_units(target):
    asm = compile_moe_gemm(target, "large", True, fp8=True)
    check_compiled(asm, target, FP8_MMA[target])
    if target.startswith("sm_"):  # launched under the kernel before it (PDL)
        from aot import GRID_DEPENDENCY
        assert all(op in asm["ptx"] for op in GRID_DEPENDENCY)


@pytest.mark.aot
@pytest.mark.parametrize("target", ["sm_90", "sm_100", "gfx942", "gfx950"])
@pytest.mark.parametrize("fp8,block", [(False, 128), (True, 128), (True, 32)], ids=["bf16", "fp8-128", "fp8-32"])
@pytest.mark.parametrize("which,gated", [("small", True), ("small", False), ("large", True), ("large", False)],
                         ids=["gate_up-small", "down-small", "gate_up-large", "down-large"])
def test_moe_gemm_tables_compile_without_spills(target, fp8, block, which, gated):
    """Every tile of MOE_GEMM (bf16 and 128-block FP8 experts) and MOE_GEMM_32 (DeepSeek-V4.1's
    32-block experts, its shared expert) as launched: no local memory on NVIDIA, no scratch and LDS
    within a workgroup's on AMD. The FP8 tiles scale both accumulators each K step in registers (and
    a decode tile quantizes its activations there too), so they need more registers than bf16's. The
    prefill tiles of 32-blocks reach the E4M3 MMA (K steps of 32; the decode tiles' 16 rows on
    mma.sync or MFMA, as at 128)."""
    from aot import assert_no_spills

    asm = compile_moe_gemm(target, which, gated, fp8=fp8, block=block, sass=target.startswith("sm_"))
    if fp8 and block == 32 and which == "large":
        check_compiled(asm, target, FP8_32_MMA[target])
    assert_no_spills(asm, target)


@pytest.mark.aot
@pytest.mark.parametrize("target", ["sm_90", "sm_100", "gfx942", "gfx950"])
@pytest.mark.parametrize("which", ["small", "large"])
def test_fp32_gated_tiles_fit_the_shared_memory(target, which):
    """fp32 experts (a MoE model run in float32) at the stages the launch fits them to: the gated
    tiles, the largest, within one block's shared memory (LDS on AMD); at two stages on gfx942 they
    took 72 and 80 KiB of its 64."""
    from aot import LDS_BYTES, SHARED_BYTES

    cfg = getattr(pick(MOE_TUNING[128], target), which)
    asm = compile_moe_gemm(target, which, True, fp8=False, dtype="fp32",
                           num_stages=stages_within(cfg, target, 4, 4, True, False))
    assert int(asm["shared"]) <= {**SHARED_BYTES, **LDS_BYTES}[target]


# FP4 experts: the block-scaled MMA where FP4_SCALED_MMA says the target has one (E2M1 weights with
# MXFP8 activations), elsewhere the unpacked weight rows' bf16 MMA: on sm_90 wgmma for decode blocks
# too, the weight rows being its 64-row operand
FP4_MMA = {
    ("sm_90", "large"): r"wgmma\.mma_async\S*\.f32\.bf16\.bf16",
    ("sm_90", "small"): r"wgmma\.mma_async\S*\.f32\.bf16\.bf16",
    ("sm_100", "large"): r"tcgen05\.mma\S*kind::mxf8f6f4\.block_scale",
    ("sm_100", "small"): r"tcgen05\.mma\S*kind::mxf8f6f4\.block_scale",
    ("gfx942", "large"): r"v_mfma_f32_\w+_bf16", ("gfx942", "small"): r"v_mfma_f32_\w+_bf16",
    ("gfx950", "large"): r"v_mfma_scale_f32_\w+_f8f6f4", ("gfx950", "small"): r"v_mfma_scale_f32_\w+_f8f6f4",
}


@pytest.mark.aot
@pytest.mark.parametrize("target", ["sm_90", "sm_100", "gfx942", "gfx950"])
@pytest.mark.parametrize("which,gated", [("small", True), ("large", True), ("small", False), ("large", False)],
                         ids=["gate_up-small", "gate_up-large", "down-small", "down-large"])
def test_fp4_moe_gemm_reaches_the_matrix_units(target, which, gated):
    """Each tile of MOE_FP4_GEMM reaches its MMA under PDL, without spills: on sm_90 and gfx942 the
    weights are unpacked in registers, so every tile must hold them there."""
    from aot import GRID_DEPENDENCY, assert_no_spills, compile_asm, pdl

    cfg = getattr(pick(MOE_FP4_GEMM, target), which)
    scaled = pick(FP4_SCALED_MMA, target)
    quantize = scaled and which == "small"  # a decode tile quantizes to MXFP8 as it loads (quantizes_in_gemm)
    signature = {**SIGNATURE, "a_scale_ptr": "*u8", "b_scale_ptr": "*u8", "b_ptr": "*u8", "c_ptr": "*bf16",
                 "a_ptr": "*fp8e4nv" if scaled and not quantize else "*bf16"}
    constexprs = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                      GATED=gated, HAS_LIMIT=gated, FP8=False, SCALE_BLOCK=32, PDL=pdl(target),
                      FP4=True, SCALED_MMA=scaled, EVEN_K=True,
                      PTX_UNPACK=not scaled and pick(FP4_PTX_UNPACK, target) and ptx_unpack_fits(cfg),
                      QUANTIZE_A=quantize, ACCUMULATE=False)
    asm = compile_asm(_moe_gemm_kernel, signature, constexprs, target, num_warps=cfg.num_warps,
                      num_stages=cfg.num_stages, sass=target.startswith("sm_"),
                      divisible_by_16=["K", "stride_am", "stride_as", "stride_bn", "stride_bsn", "stride_cm", "stride_om"])
    check_compiled(asm, target, FP4_MMA[target, which])
    if target.startswith("sm_"):
        assert all(op in asm["ptx"] for op in GRID_DEPENDENCY)
    assert_no_spills(asm, target)


@pytest.mark.aot
@pytest.mark.parametrize("target", ["sm_90", "sm_100", "gfx942", "gfx950"])
def test_alignment_kernels_compile(target):
    from aot import GRID_DEPENDENCY, compile_asm, pdl

    cfg = pick(ALIGN, target)
    shape = dict(CHUNK=cfg.chunk, EXPERTS=256, PDL=pdl(target))
    layout = {"n": "i32", "top_k": "i32", "stride_t": "i32"}
    kernels = [
        (_count_kernel, {"ids_ptr": "*i64", "chunk_counts_ptr": "*i32", **layout}, shape),
        (_scan_kernel, {"chunk_counts_ptr": "*i32", "chunk_start_ptr": "*i32", "block_expert_ptr": "*i32",
                        "num_padded_ptr": "*i32", "num_chunks": "i32", "num_experts": "i32", "num_blocks": "i32"},
         dict(BLOCK_M=64, EXPERTS=256, SCAN_ROWS=cfg.scan_rows, SCAN_BLOCKS=cfg.scan_blocks, PDL=pdl(target))),
        (_place_kernel, {"ids_ptr": "*i64", "chunk_start_ptr": "*i32", "sorted_ids_ptr": "*i32", **layout}, shape),
        (_align_one_chunk_kernel, {"ids_ptr": "*i64", "sorted_ids_ptr": "*i32", "block_expert_ptr": "*i32",
                                   "num_padded_ptr": "*i32", **layout, "num_experts": "i32", "num_blocks": "i32"},
         dict(shape, BLOCK_M=16, SCAN_BLOCKS=cfg.scan_blocks)),
    ]
    for kernel, signature, constexprs in kernels:
        asm = compile_asm(kernel, signature, constexprs, target, num_warps=cfg.num_warps)
        assert ("ptx" if target.startswith("sm_") else "amdgcn") in asm
        if target.startswith("sm_"):
            assert all(op in asm["ptx"] for op in GRID_DEPENDENCY)
