"""A decode step's experts in one launch (moe_one_launch.py) against the two grouped GEMM launches.

Fresh random routings every run (tokens on the same expert, experts with no tokens, experts of more
than one block), outputs and counters poisoned first, the counters zeroed by the real dispatch
launch: to the bit against ``fused_moe``'s two launches with the activations quantized in them, and
against native within each format's bound (FP8, MXFP8: the activations' roundings native does not
make). Through ``TritonMoE.route_experts`` a decode step launches no grouped GEMM; a prefill does.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from test_triton_moe import (activations, random_experts, rel_err, routing_weights, rows_of_each_kind, stack_in,
                             with_counters)
from test_triton_moe_dispatch import CPU, v4_routing

from engine.backends.triton import fused_moe as fused
from engine.backends.triton.fp8_gemm import GemmConfig
from engine.backends.triton.moe import TritonMoE
from engine.backends.triton.moe_align import align_by_expert
from engine.backends.triton.moe_dispatch import route_and_align
from engine.backends.triton.moe_one_launch import arrival_counts, fits_one_launch, moe_one_launch
from engine.core.native.moe import NativeMoE

DECODE = GemmConfig(16, 32, 128, 1, 4, 1)  # K steps of one FP8 scale group, as the GPUs' decode tiles
DECODE_32 = GemmConfig(16, 32, 32, 1, 4, 1)  # of one 32-channel group (DeepSeek-V4.1's blocks)

TWO_BLOCKS = GemmConfig(8, 32, 64, 1, 4, 1)

CASES = [  # scheme, scaled_mma, tokens, experts, top_k, bound, config, FP8 block edge
    ("dense", False, 1, 8, 2, 1e-5, DECODE, 128),  # most experts empty
    # every token on every expert: 13 rows each, two blocks of 8 (the second 3 rows and padding)
    ("dense", False, 13, 3, 3, 1e-5, TWO_BLOCKS, 128),
    ("fp8_block", False, 6, 4, 2, 0.1, DECODE, 128),
    ("fp8_block", False, 6, 4, 2, 0.1, DECODE_32, 32),  # K steps of 32, each a 32-block's
    ("fp4", False, 6, 4, 2, 1e-5, DECODE, 128),  # dequantized in registers
    ("fp4", True, 6, 4, 2, 0.1, DECODE, 128),  # MXFP8 activations, tl.dot_scaled
]


@pytest.mark.interpret
@pytest.mark.parametrize("scheme,scaled,tokens,experts,top_k,bound,config,block", CASES,
                         ids=["dense-1", "dense-13", "fp8", "fp8-32", "fp4", "fp4-scaled"])
def test_one_launch_equals_two(seed, poisoned_empty, scheme, scaled, tokens, experts, top_k, bound, config, block):
    """H = 160 and I = 96: K tails in both GEMMs (of 32 in 128-channel steps); the shared expert folded
    as the stack's last (every token's); 3 or 4 column tiles of I and 5 of H per block."""
    hidden, inner = 160, 96
    cfg = v4_routing(experts, top_k, False, shared=True)
    w = stack_in(scheme, random_experts(experts + 1, hidden, inner, torch.float32, swiglu_limit=1.0), block)
    x = activations(tokens, hidden, torch.float32, scale=2.0)
    weights, ids, blocks, _ = route_and_align(torch.randn(tokens, experts) * 3, cfg, None, experts + 1,
                                              config.block_m, arrival_counts=arrival_counts(tokens, hidden, config))
    assert blocks.counters.numel() == blocks.num_blocks + 1 + tokens * 5
    kw = dict(swiglu_limit=w.swiglu_limit, gate_up_scale=w.gate_up_scale, down_scale=w.down_scale)
    got = moe_one_launch(x, blocks, w.gate_up, w.down, weights, ids, config, torch.full_like(x, float("nan")),
                         scaled_mma=scaled, **kw)
    two = fused.fused_moe(x, weights, ids, w.gate_up, w.down, out=torch.full_like(x, float("nan")), config=config,
                          scaled_mma=scaled, quantize_in_gemm=scheme != "dense" and (scheme == "fp8_block" or scaled),
                          **kw)
    assert not got.isnan().any() and torch.equal(got, two)
    assert rel_err(got, NativeMoE(None).experts(x, weights, ids, w)) < bound


@pytest.mark.interpret
def test_one_launch_adds_to_its_output(seed, poisoned_empty):
    """accumulate (the shared stack's launch after the routed one's): out's values plus the experts' sum."""
    tokens, experts, hidden, inner = 3, 4, 64, 64
    w = random_experts(experts, hidden, inner, torch.float16)
    x, prior = activations(tokens, hidden, torch.float16), activations(tokens, hidden, torch.float16)
    cfg = dataclasses.replace(v4_routing(experts, 2, False, shared=False), weight_dtype=torch.float16)
    weights, ids, blocks, _ = route_and_align(torch.randn(tokens, experts), cfg, None, experts, DECODE.block_m,
                                              arrival_counts=arrival_counts(tokens, hidden, DECODE))
    got = moe_one_launch(x, blocks, w.gate_up, w.down, weights, ids, DECODE, prior.clone(), swiglu_limit=None,
                         gate_up_scale=None, down_scale=None, accumulate=True)
    assert torch.equal(got, prior + fused.fused_moe(x, weights, ids, w.gate_up, w.down, config=DECODE))


@pytest.mark.interpret
@pytest.mark.parametrize("tokens,top_k", [(4, 2), (7, 4)])
def test_one_launch_adds_nothing_for_ids_of_no_expert(seed, poisoned_empty, tokens, top_k):
    """Rows with every id real, every id -1 and some -1 (test_triton_moe's ``rows_of_each_kind``), the
    -1 pairs weighted: to the bit the two launches' output, native's where a row has a real id, and
    what out held where it has none."""
    experts, hidden, inner = 4, 96, 64
    ids, kind = rows_of_each_kind(tokens, experts, top_k)
    w = random_experts(experts, hidden, inner, torch.float32, swiglu_limit=1.0)
    x, weights, prior = activations(tokens, hidden, torch.float32), routing_weights(tokens, top_k), \
        activations(tokens, hidden, torch.float32)
    blocks = with_counters(align_by_expert(ids, experts, DECODE.block_m), tokens, hidden, DECODE)
    got = moe_one_launch(x, blocks, w.gate_up, w.down, weights, ids, DECODE, prior.clone(), swiglu_limit=1.0,
                         gate_up_scale=None, down_scale=None)
    two = fused.fused_moe(x, weights, ids, w.gate_up, w.down, swiglu_limit=1.0, out=prior.clone(), config=DECODE)
    want = NativeMoE(None).experts(x, weights, ids, w)
    assert torch.equal(got, two) and torch.equal(got[kind == 1], prior[kind == 1])
    assert not got.isnan().any() and rel_err(got[kind != 1], want[kind != 1]) < 1e-5


@pytest.mark.interpret
@pytest.mark.parametrize("tokens", [2, 24], ids=["decode", "prefill"])
def test_route_experts_launches_no_grouped_gemm_at_decode(seed, monkeypatch, tokens):
    """A decode step's layer (routing in one launch) runs its experts in one more; a prefill's in two
    grouped GEMM launches, as before; both equal to the bit with one launch turned off."""
    cfg = v4_routing(4, 2, False, shared=True)
    w = random_experts(5, 64, 64, torch.float32, swiglu_limit=1.0)
    x, logits = activations(tokens, 64, torch.float32), torch.randn(tokens, 4)
    grouped = []
    gemm = fused._grouped_gemm
    monkeypatch.setattr(fused, "_grouped_gemm", lambda *a, **kw: grouped.append(1) or gemm(*a, **kw))
    moe = TritonMoE(None)
    got = moe.route_experts(x, logits, cfg, w)
    assert len(grouped) == (0 if tokens == 2 else 2)
    moe.one_launch = False
    assert torch.equal(got, moe.route_experts(x, logits, cfg, w))
    assert fits_one_launch(w.gate_up, DECODE, tokens, 3) and CPU.type == "cpu"


# GPU: DeepSeek-V4-Flash's decode shapes, eager and replayed from a CUDA graph


@pytest.mark.gpu
@pytest.mark.parametrize("scheme,block", [("dense", 128), ("fp8_block", 128), ("fp8_block", 32), ("fp4", 128)])
@pytest.mark.parametrize("tokens", [1, 8, 64])
def test_one_launch_gpu(seed, scheme, block, tokens):
    """256 routed experts, top-6 and the shared one folded, a quarter of V4-Flash's hidden size, in
    bf16, FP8 (128- or V4.1's 32-blocks) or FP4 weights: route_experts (one launch for the experts) equal to the bit to it with
    one launch off (two), eager and from a graph replayed on fresh inputs (the counters zeroed by the
    dispatch launch each replay), and within bounds of native."""
    experts, top_k, hidden, inner = 256, 6, 1024, 512
    cfg = dataclasses.replace(v4_routing(experts, top_k, False, shared=True), weight_dtype=torch.bfloat16)
    cfg = dataclasses.replace(cfg, correction_bias=cfg.correction_bias.cuda())
    w = stack_in(scheme, random_experts(experts + 1, hidden, inner, torch.float32, "cuda", swiglu_limit=10.0), block)
    if scheme == "dense":
        w = dataclasses.replace(w, gate_up=w.gate_up.bfloat16(), down=w.down.bfloat16())
    logits = torch.empty(tokens, experts, device="cuda")
    x = torch.empty(tokens, hidden, dtype=torch.bfloat16, device="cuda")
    one, two = TritonMoE(None), TritonMoE(None)
    two.one_launch = False

    def fill():
        logits.copy_(torch.randn(tokens, experts, device="cuda") * 3)
        x.copy_(activations(tokens, hidden, torch.bfloat16, "cuda", scale=2.0))

    fill()
    assert torch.equal(one.route_experts(x, logits, cfg, w), two.route_experts(x, logits, cfg, w))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        one.route_experts(x, logits, cfg, w)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = one.route_experts(x, logits, cfg, w)
    for _ in range(3):
        fill()
        graph.replay()
        assert torch.equal(out, two.route_experts(x, logits, cfg, w))
    assert rel_err(out, NativeMoE(None).route_experts(x, logits, cfg, w)) < (0.02 if scheme == "dense" else 0.1)


# ahead-of-time compilation: the decode tiles of each format, with the flags' atomics


ONE_LAUNCH_SIGNATURE = {
    **{name: "*i32" for name in ["counters_ptr", "sorted_ids_ptr", "block_expert_ptr", "num_padded_ptr"]},
    "h_ptr": "*bf16", "rows_ptr": "*bf16", "out_ptr": "*bf16", "x_ptr": "*bf16", "topk_weight_ptr": "*fp32",
    "topk_id_ptr": "*i64",
    **{name: "i32" for name in ["num_blocks", "H", "I", "num_assignments", "top_k", "stride_xm", "stride_ge",
                                "stride_gn", "stride_gse", "stride_gsn", "stride_de", "stride_dn", "stride_dse",
                                "stride_dsn", "stride_hm", "stride_rm", "stride_om", "stride_wt", "stride_it"]},
    "swiglu_limit": "fp32"}


def compile_one_launch(target: str, scheme: str, block: int = 128, sass: bool = False) -> dict[str, str]:
    """The decode tile of ``scheme`` (FP8 in ``block``-blocks) from its table, as TritonMoE launches it."""
    from aot import compile_asm, pdl

    from engine.backends.triton.moe_tiles import FP4_PTX_UNPACK, FP4_SCALED_MMA, MOE_FP4_GEMM, MOE_TUNING
    from engine.backends.triton.moe_one_launch import _moe_one_launch_kernel, one_launch_warps
    from engine.backends.triton.target import pick

    fp4, fp8 = scheme == "fp4", scheme == "fp8_block"
    cfg = pick(MOE_FP4_GEMM if fp4 else MOE_TUNING[block], target).small
    scaled = fp4 and pick(FP4_SCALED_MMA, target)
    weight = {"dense": "*bf16", "fp8_block": "*fp8e4nv", "fp4": "*u8"}[scheme]
    scale = {"dense": "*fp32", "fp8_block": "*fp32", "fp4": "*u8"}[scheme]
    signature = {**ONE_LAUNCH_SIGNATURE, "gate_up_ptr": weight, "down_ptr": weight, "gate_up_scale_ptr": scale,
                 "down_scale_ptr": scale}
    constexprs = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, HAS_LIMIT=True, FP8=fp8,
                      SCALE_BLOCK=32 if fp4 else block, FP4=fp4, SCALED_MMA=scaled, EVEN_H=True, EVEN_I=True,
                      PTX_UNPACK=fp4 and not scaled and pick(FP4_PTX_UNPACK, target), QUANTIZE_A=fp8 or scaled,
                      ACCUMULATE=False, PDL=pdl(target))
    return compile_asm(_moe_one_launch_kernel, signature, constexprs, target, num_warps=one_launch_warps(cfg, target),
                       num_stages=cfg.num_stages, sass=sass or target.startswith("sm_"),
                       divisible_by_16=["H", "I", "stride_xm", "stride_gn", "stride_dn", "stride_hm", "stride_rm",
                                        "stride_om", "stride_gsn", "stride_dsn"])


@pytest.mark.aot
@pytest.mark.parametrize("target", ["sm_90", "sm_100", "gfx942", "gfx950"])
def test_one_launch_of_32_block_experts_compiles_without_spills(target):
    """DeepSeek-V4.1's shared expert (32-blocks, K steps of 32, its activations quantized in the GEMMs)
    in one launch: the 128-blocks' decode MMA (gfx950: its E4M3 MFMA of K 16), no local memory on
    NVIDIA, no scratch and LDS within a workgroup's on AMD."""
    from aot import assert_no_spills
    from test_triton_moe import check_compiled

    asm = compile_one_launch(target, "fp8_block", 32, sass=target.startswith("sm_"))
    check_compiled(asm, target, r"v_mfma_f32_\w+_fp8_fp8" if target == "gfx950" else DECODE_MMA[target, "fp8_block"])
    assert_no_spills(asm, target)


# the decode tiles' MMA: 16 rows stay on mma.sync on NVIDIA, FP8 widened to f16 there (as in the two
# launches); FP4 as test_triton_moe's FP4_MMA (wgmma on the unpacked weight rows on sm_90, the
# block-scaled MMA on sm_100 and gfx950)
DECODE_MMA = {
    ("sm_90", "dense"): r"mma\.sync\S*\.bf16\.bf16", ("sm_100", "dense"): r"mma\.sync\S*\.bf16\.bf16",
    ("sm_90", "fp8_block"): r"mma\.sync\S*\.f16\.f16", ("sm_100", "fp8_block"): r"mma\.sync\S*\.f16\.f16",
    ("gfx942", "dense"): r"v_mfma_f32_\w+_bf16", ("gfx950", "dense"): r"v_mfma_f32_\w+_bf16",
    ("gfx942", "fp8_block"): r"v_mfma_f32_\w+_f16", ("gfx950", "fp8_block"): r"v_mfma_f32_\w+_f8f6f4",
}
# at GPU scope: the ticket's relaxed add, a flag's release (a reduction: its result unused) and the
# spin's acquire (an add of 0, a load); on CDNA the release writes L2 back (buffer_wbl2) and the
# acquire invalidates (buffer_inv)
FLAG_ATOMICS = {"cuda": (r"atom\.global\.gpu\.relaxed\.add", r"red\.global\.gpu\.release\.add",
                         r"ld\.global\.gpu\.acquire"),
                "hip": (r"buffer_wbl2", r"buffer_inv", r"global_atomic_add")}


@pytest.mark.aot
@pytest.mark.parametrize("target", ["sm_90", "sm_100", "gfx942", "gfx950"])
@pytest.mark.parametrize("scheme", ["dense", "fp8_block", "fp4"])
def test_one_launch_compiles_to_the_matrix_units(target, scheme):
    """Each format's decode tile reaches the MMA the two launches' tiles do (test_triton_moe's
    tables: the FP8 and MXFP8 paths quantize their activations in the GEMM), with the flags' atomics
    at GPU scope, no local memory on NVIDIA and no scratch or LDS past the limit on CDNA."""
    from aot import GRID_DEPENDENCY, assert_no_spills
    from test_triton_moe import FP4_MMA, check_compiled

    asm = compile_one_launch(target, scheme)
    check_compiled(asm, target, FP4_MMA[target, "small"] if scheme == "fp4" else DECODE_MMA[target, scheme])
    nvidia = target.startswith("sm_")
    text = asm["ptx"] if nvidia else asm["amdgcn"]
    assert all(re.search(op, text) for op in FLAG_ATOMICS["cuda" if nvidia else "hip"])
    if nvidia:
        assert all(op in asm["ptx"] for op in GRID_DEPENDENCY)
    assert_no_spills(asm, target)
