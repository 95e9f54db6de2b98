"""The one-launch MoE dispatch (routing + alignment, moe_dispatch.py) and ``TritonMoE.route_experts``.

Fresh random logits every run, outputs poisoned first (``poisoned_empty``). The dispatch must equal
the unfused composition (``route``, then ``align_by_expert``) to the bit, ties in the top-k
included, and native's routing on tokens clear of near ties; the layer through ``route_experts``
must equal ``route`` + ``experts`` on Triton to the bit and native's within each format's bound,
for a decode step's batch (one launch routes and aligns) and a prefill's (they run apart).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import triton
import triton.language as tl
from test_triton_moe import (activations, fp4_experts, random_experts, random_ids, rel_err, routing_weights,
                             stack_in)
from test_triton_moe_routing import choice_scores, clear_of_ties

from engine.backends.triton.fused_moe import fused_moe
from engine.backends.triton.moe import TritonMoE
from engine.backends.triton.moe_align import ALIGN, align_by_expert
from engine.backends.triton.moe_dispatch import (DISPATCH, _route_align_kernel, block_tokens, fits_one_program,
                                                 route_and_align)
from engine.backends.triton.moe_routing import ROUTE_TILE, SCORINGS, route
from engine.backends.triton.target import pick
from engine.core.families.moe import RoutingConfig
from engine.core.native.moe import NativeMoE

CPU = torch.device("cpu")


def v4_routing(experts: int, top_k: int, hashed: bool, shared: bool, vocab: int = 50, **kw) -> RoutingConfig:
    """DeepSeek-V4's: sqrtsoftplus with the no-aux bias, or hash by token id; the shared expert folded
    after the routed ones."""
    table = torch.rand(vocab, experts).argsort(-1)[:, :top_k] if hashed else None
    return RoutingConfig(num_experts=experts, top_k=top_k, scoring="sqrtsoftplus", routed_scaling_factor=1.5,
                         correction_bias=None if hashed else torch.randn(experts) * 0.1, hash_table=table,
                         shared_expert=experts if shared else None, **kw)


def same_blocks(got, want):
    assert torch.equal(got.sorted_ids, want.sorted_ids) and torch.equal(got.block_expert, want.block_expert)
    assert torch.equal(got.num_padded, want.num_padded) and got.num_assignments == want.num_assignments
    assert got.block_m == want.block_m


def check_dispatch(logits, cfg, input_ids, block_m=16, shared_block_m=None):
    """Folded (or no shared expert): one stack for every column; with ``shared_block_m`` the routed
    columns over the routed stack and the shared column over its own."""
    k, apart = cfg.top_k, shared_block_m is not None
    stack = cfg.num_experts + (cfg.shared_expert is not None and not apart)
    weights, ids, blocks, shared = route_and_align(logits, cfg, input_ids, stack, block_m, shared_block_m)
    want_w, want_ids = route(logits, cfg, input_ids)
    assert torch.equal(weights, want_w) and torch.equal(ids, want_ids)
    same_blocks(blocks, align_by_expert(want_ids[:, :k] if apart else want_ids, stack, block_m))
    assert (shared is None) == (not apart)
    if apart:
        same_blocks(shared, align_by_expert(want_ids[:, k:], 1, shared_block_m))
    return weights, ids


@pytest.mark.interpret
@pytest.mark.parametrize("hashed", [False, True], ids=["noaux", "hash"])
@pytest.mark.parametrize("shared", [False, True], ids=["no-shared", "shared-folded"])
@pytest.mark.parametrize("tokens,experts,top_k", [(1, 8, 2), (3, 16, 4), (16, 8, 3), (13, 60, 6)])
def test_dispatch_equals_route_then_align(seed, poisoned_empty, hashed, shared, tokens, experts, top_k):
    """One pass, and several: 16 tokens of 4 lanes in two blocks of 8, 13 tokens of 8 lanes in four
    blocks of 4 (the last one short); experts not a power of two; with one token most get none."""
    cfg = v4_routing(experts, top_k, hashed, shared)
    logits, input_ids = torch.randn(tokens, experts) * 3, torch.randint(50, (tokens,))
    assert fits_one_program(tokens, cfg, CPU)
    weights, ids = check_dispatch(logits, cfg, input_ids)
    if shared:  # the published formats' layout: the shared expert in a stack of its own
        check_dispatch(logits, dataclasses.replace(cfg, shared_expert=0), input_ids, shared_block_m=4)
    ref_w, ref_ids = NativeMoE(None).route(logits, cfg, input_ids)
    clear = clear_of_ties(logits, cfg)
    assert torch.equal(ids[clear], ref_ids[clear])
    torch.testing.assert_close(weights[clear], ref_w[clear], rtol=2e-6, atol=1e-7)


@pytest.mark.interpret
@pytest.mark.parametrize("scoring", sorted(SCORINGS))
def test_dispatch_breaks_top_k_ties_by_lowest_id(seed, poisoned_empty, scoring):
    """Logits of a few distinct values, so most tokens tie at the cut: among equal scores the lowest
    expert id comes first (a stable descending sort; torch.topk's order among ties is its own), the
    weights are native's up to that order, and blocks of 2 rows fall where the tied counts put them."""
    cfg = RoutingConfig(num_experts=16, top_k=4, scoring=scoring, routed_scaling_factor=2.5)
    logits = torch.randint(-2, 2, (6, 16)).float()
    weights, ids = check_dispatch(logits, cfg, None, block_m=2)
    ref_w, _ = NativeMoE(None).route(logits, cfg)
    stable = choice_scores(logits, cfg).sort(dim=1, descending=True, stable=True).indices[:, :4]
    assert torch.equal(ids, stable)
    torch.testing.assert_close(weights.sort(dim=1).values, ref_w.sort(dim=1).values, rtol=2e-6, atol=1e-7)


def test_what_fits_one_program():
    """A decode step's batch fits; a prefill's tokens or grouped top-k do not. A pass takes as many
    tokens as fit a routing tile, an alignment chunk and the one-hot budget against the stack."""
    most = pick(DISPATCH, "default").tokens
    cfg = v4_routing(8, 3, False, False)  # 4 lanes a token
    assert fits_one_program(most, cfg, CPU) and not fits_one_program(most + 1, cfg, CPU)
    assert not fits_one_program(0, cfg, CPU)
    assert not fits_one_program(1, dataclasses.replace(cfg, num_groups=2, topk_groups=1), CPU)
    (tile, _), lanes = pick(ROUTE_TILE, "default"), pick(DISPATCH, "default").lanes
    assert block_tokens(cfg, 8, "cpu") == min(tile // 8, lanes // 4)
    assert block_tokens(v4_routing(256, 6, False, True), 257, "cpu") == 1  # the one-hot: 4096 // 512 // 8
    assert block_tokens(v4_routing(256, 6, False, True), 257, "sm_90") == 4  # 32 lanes // 8
    with pytest.raises(ValueError, match="do not fit one program"):
        route_and_align(torch.zeros(most + 1, 8), cfg, None, 8, 16)


# the layer: route_experts against route + experts


def check_layer(x, logits, cfg, w, input_ids, bound):
    moe = TritonMoE(None)
    got = moe.route_experts(x, logits, cfg, w, input_ids)
    unfused = moe.experts(x, *moe.route(logits, cfg, input_ids), w)
    native = NativeMoE(None).route_experts(x, logits, cfg, w, input_ids)
    assert got.dtype == x.dtype and not got.isnan().any()
    assert torch.equal(got, unfused)
    assert rel_err(got, native) < bound


def check_layer_apart(x, logits, cfg, w, shared, input_ids, bound):
    moe, k = TritonMoE(None), cfg.top_k
    got = moe.route_experts(x, logits, cfg, w, input_ids, shared)
    weights, ids = moe.route(logits, cfg, input_ids)
    unfused = moe.experts(x, weights[:, :k], ids[:, :k], w) + moe.experts(x, weights[:, k:], ids[:, k:], shared)
    native = NativeMoE(None).route_experts(x, logits, cfg, w, input_ids, shared)
    assert not got.isnan().any() and torch.equal(got, unfused)
    assert rel_err(got, native) < bound


@pytest.mark.interpret
@pytest.mark.parametrize("tokens,dtype", [(1, torch.float32), (5, torch.float16), (24, torch.float32)],
                         ids=["decode-1", "decode-5-fp16", "prefill"])
def test_route_experts_with_the_shared_expert_apart(seed, poisoned_empty, tokens, dtype):
    """DeepSeek-V4 as published: FP4 routed experts and an FP8 shared expert in a stack of its own (id
    0 there): the dispatch aligns both stacks and the shared down GEMM adds to the routed output,
    equal to the bit to route + two experts calls + their sum."""
    experts, top_k, hidden, inner = 8, 2, 128, 128
    cfg = v4_routing(experts, top_k, False, shared=False, weight_dtype=dtype)
    cfg = dataclasses.replace(cfg, shared_expert=0)
    routed = fp4_experts(random_experts(experts, hidden, inner, torch.float32, swiglu_limit=1.0))
    shared = stack_in("fp8_block", random_experts(1, hidden, inner, torch.float32, swiglu_limit=1.0))
    x = activations(tokens, hidden, dtype, scale=2.0)
    check_layer_apart(x, torch.randn(tokens, experts) * 3, cfg, routed, shared, None, 0.1)


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_down_gemm_adds_to_its_output(seed, dtype):
    """accumulate: what out held plus the experts' sum, as torch adds the two in out's dtype."""
    x, w = activations(3, 64, dtype, scale=2.0), random_experts(4, 64, 64, dtype)
    weights, ids = routing_weights(3, 2), random_ids(3, 4, 2)
    prior = activations(3, 64, dtype)
    got = fused_moe(x, weights, ids, w.gate_up, w.down, out=prior.clone(), accumulate=True)
    assert torch.equal(got, prior + fused_moe(x, weights, ids, w.gate_up, w.down))
    with pytest.raises(ValueError, match="output to add to"):
        fused_moe(x, weights, ids, w.gate_up, w.down, accumulate=True)


LAYER_CASES = [  # scheme, dtype, bound, tokens, hashed; 1 and 5 tokens: one dispatch launch, 24: apart
    ("dense", torch.float32, 1e-5, 1, False), ("dense", torch.float16, 3e-3, 5, True),
    ("dense", torch.float32, 1e-5, 24, True),
    # FP8: E4M3 roundings of x and of the SwiGLU output, which native does not make (test_triton_moe's bound)
    ("fp8_block", torch.float32, 0.1, 5, False), ("fp8_block", torch.float32, 0.1, 24, True),
    ("fp4", torch.float32, 1e-5, 1, True), ("fp4", torch.float32, 1e-5, 24, False),
]


@pytest.mark.interpret
@pytest.mark.parametrize("scheme,dtype,bound,tokens,hashed", LAYER_CASES,
                         ids=[f"{c[0]}-{str(c[1])[6:]}-{c[3]}-{'hash' if c[4] else 'noaux'}" for c in LAYER_CASES])
def test_route_experts_equals_the_unfused_layer(seed, poisoned_empty, scheme, dtype, bound, tokens, hashed):
    """DeepSeek-V4's layer with its shared expert folded in as the stack's last, in each weight format,
    for a decode step's batch and a prefill's."""
    experts, top_k, inner = 8, 2, 128
    hidden = 128 if scheme == "fp8_block" else 64
    cfg = v4_routing(experts, top_k, hashed, shared=True, weight_dtype=dtype)
    assert fits_one_program(tokens, cfg, CPU) == (tokens < 24)
    w = random_experts(experts + 1, hidden, inner, torch.float32, swiglu_limit=1.0)
    w = stack_in(scheme, dataclasses.replace(w, gate_up=w.gate_up.to(dtype), down=w.down.to(dtype)))
    x = activations(tokens, hidden, dtype, scale=2.0)
    check_layer(x, torch.randn(tokens, experts) * 3, cfg, w, torch.randint(50, (tokens,)), bound)


@pytest.mark.interpret
def test_route_experts_without_a_shared_expert(seed, poisoned_empty):
    """Qwen3-MoE's layer: softmax top-k, no shared expert, FP4 weights dequantized in registers."""
    cfg = RoutingConfig(num_experts=8, top_k=2, scoring="softmax")
    w = fp4_experts(random_experts(8, 64, 64, torch.float32))
    check_layer(activations(3, 64, torch.float32), torch.randn(3, 8), cfg, w, None, 1e-5)


# GPU: DeepSeek-V4-Flash's routing, fused and unfused, eager and in a CUDA graph


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["folded", "hash", "published"])
@pytest.mark.parametrize("tokens", [1, 8, 64, 128])
def test_route_experts_gpu(seed, layout, tokens):
    """256 experts, top-6 and the shared one, a quarter of the hidden size: folded in bf16 (no-aux or
    hash routing), or as published (FP4 routed experts, the FP8 shared one in its own stack, whose down
    GEMM adds to the routed output): route_experts equals route + experts (+ the sum) to the bit, eager
    and replayed from a graph on fresh inputs (8 tokens: one pass, 64: several, 128: apart)."""
    from test_triton_moe import fp4_experts as fp4

    experts, top_k, hidden, inner, vocab = 256, 6, 1024, 512, 1000
    hashed, apart = layout == "hash", layout == "published"
    cfg = RoutingConfig(num_experts=experts, top_k=top_k, scoring="sqrtsoftplus", routed_scaling_factor=1.5,
                        correction_bias=None if hashed else torch.randn(experts, device="cuda") * 0.1,
                        hash_table=torch.rand(vocab, experts, device="cuda").argsort(-1)[:, :top_k] if hashed else None,
                        weight_dtype=torch.bfloat16, shared_expert=0 if apart else experts)
    if apart:
        w = fp4(random_experts(experts, hidden, inner, torch.float32, "cuda", swiglu_limit=10.0))
        shared = stack_in("fp8_block", random_experts(1, hidden, inner, torch.bfloat16, "cuda", swiglu_limit=10.0))
    else:
        w, shared = random_experts(experts + 1, hidden, inner, torch.bfloat16, "cuda", swiglu_limit=10.0), None
    moe = TritonMoE(None)
    logits = torch.empty(tokens, experts, device="cuda")
    x = torch.empty(tokens, hidden, dtype=torch.bfloat16, device="cuda")
    input_ids = torch.empty(tokens, dtype=torch.long, device="cuda")

    def fill():
        logits.copy_(torch.randn(tokens, experts, device="cuda") * 3)
        x.copy_(activations(tokens, hidden, torch.bfloat16, "cuda", scale=2.0))
        input_ids.copy_(torch.randint(vocab, (tokens,), device="cuda"))

    def unfused():
        weights, ids = moe.route(logits, cfg, input_ids)
        if shared is None:
            return moe.experts(x, weights, ids, w)
        return moe.experts(x, weights[:, :top_k], ids[:, :top_k], w) + moe.experts(x, weights[:, top_k:],
                                                                                   ids[:, top_k:], shared)

    def fused():
        return moe.route_experts(x, logits, cfg, w, input_ids, shared)

    fill()
    assert fits_one_program(tokens, cfg, x.device) == (tokens <= 64)
    assert torch.equal(fused(), unfused())
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fused()  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused()
    for _ in range(3):
        fill()
        graph.replay()
        assert torch.equal(out, unfused())


# ahead-of-time compilation


ROUTING_SIGNATURE = {  # the routing's arguments
    "logits_ptr": "*fp32", "bias_ptr": "*fp32", "table_ptr": "*i64", "token_ids_ptr": "*i64", "E": "i32",
    "stride_l": "i32", "scaling": "fp32", "weights_ptr": "*fp32", "ids_ptr": "*i64", "sorted_ids_ptr": "*i32",
    "block_expert_ptr": "*i32", "num_padded_ptr": "*i32", "T": "i32", "num_experts": "i32", "num_blocks": "i32",
    "shared_sorted_ids_ptr": "*i32", "shared_block_expert_ptr": "*i32", "shared_num_padded_ptr": "*i32",
    "shared_num_blocks": "i32", "counters_ptr": "*i32", "num_counters": "i32", "shared_counters_ptr": "*i32",
    "num_shared_counters": "i32"}


@pytest.mark.aot
@pytest.mark.parametrize("target", ["sm_90", "sm_100", "gfx942", "gfx950"])
@pytest.mark.parametrize("hashed,apart", [(False, False), (True, False), (False, True)],
                         ids=["noaux", "hash", "shared-apart"])
def test_dispatch_kernel_compiles(target, hashed, apart):
    """DeepSeek-V4-Flash's routing (256 experts, top-6 and the shared one, folded or in its own
    stack), a pass of as many tokens as it takes there: 8 on AMD (64 lanes), without scratch or
    past the LDS."""
    from aot import GRID_DEPENDENCY, LDS_BYTES, amd_scratch_and_lds, compile_asm, local_memory_ops, pdl

    (_, num_warps), align = pick(ROUTE_TILE, target), pick(ALIGN, target)
    stack = 256 if apart else 257
    block_t = block_tokens(v4_routing(256, 6, hashed, True), stack, target)
    constexprs = dict(SCORING=SCORINGS["sqrtsoftplus"], HAS_BIAS=not hashed, HASHED=hashed, RENORMALIZE=True,
                      TOP_K=6, K_POW2=8, EXPERTS=256, ROUND_TO=tl.bfloat16, SHARED=256, BLOCK_T=block_t, BLOCK_M=16,
                      STACK_EXPERTS=triton.next_power_of_2(stack), SCAN_BLOCKS=align.scan_blocks,
                      SHARED_APART=apart, SHARED_BLOCK_M=16, PDL=pdl(target))
    asm = compile_asm(_route_align_kernel, ROUTING_SIGNATURE, constexprs, target, num_warps=num_warps,
                      sass=target == "sm_90")
    assert ("ptx" if target.startswith("sm_") else "amdgcn") in asm
    if target == "sm_90":  # a pass's comparisons held in registers (8 tokens a pass: spills)
        assert local_memory_ops(asm["sass"]) == 0
    if target.startswith("sm_"):
        assert all(op in asm["ptx"] for op in GRID_DEPENDENCY)
    else:
        scratch, lds = amd_scratch_and_lds(asm)
        assert block_t == 8 and scratch == 0 and lds <= LDS_BYTES[target]


@pytest.mark.aot
@pytest.mark.parametrize("target", ["sm_90", "sm_100", "gfx942", "gfx950"])
def test_adding_down_gemm_compiles(target):
    """The shared stack's decode down GEMM, adding to the routed output: the same MMA as without."""
    from aot import compile_asm, pdl
    from test_triton_moe import BF16_MMA, SIGNATURE, check_compiled

    from engine.backends.triton.fused_moe import _moe_gemm_kernel
    from engine.backends.triton.moe_tiles import MOE_GEMM

    cfg = pick(MOE_GEMM, target).small
    signature = {**SIGNATURE, "a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*bf16"}
    constexprs = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                      GATED=False, HAS_LIMIT=False, FP8=False, SCALE_BLOCK=128, PDL=pdl(target), FP4=False,
                      SCALED_MMA=False, EVEN_K=True, PTX_UNPACK=False, QUANTIZE_A=False, ACCUMULATE=True)
    asm = compile_asm(_moe_gemm_kernel, signature, constexprs, target, num_warps=cfg.num_warps,
                      num_stages=cfg.num_stages, divisible_by_16=["K", "stride_am", "stride_bn", "stride_cm",
                                                                  "stride_om"])
    check_compiled(asm, target, BF16_MMA[target, "small"])
