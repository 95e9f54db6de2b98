"""The router's GEMV, routing and alignment in one launch (moe_router.py) and ``TritonMoE.route_experts``
given a ``Router``.

Fresh random inputs every run, outputs poisoned first (``poisoned_empty``). The launch must equal
the GEMV (gemv.py) followed by the dispatch (moe_dispatch.py) to the bit, the counters of the
experts' one launch zeroed and its own counter left at 0; the layer given the router must equal the
layer given the router's logits, and take the fused launch only for one row.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import triton
import triton.language as tl
from test_triton_moe import activations, random_experts
from test_triton_moe_dispatch import ROUTING_SIGNATURE, same_blocks, v4_routing

from engine.backends.triton import moe as triton_moe
from engine.backends.triton.attention_decode import arrival_counters
from engine.backends.triton.gemv import GEMV, gemv
from engine.backends.triton.linear import TritonLinear
from engine.backends.triton.moe import TritonMoE
from engine.backends.triton.moe_align import ALIGN
from engine.backends.triton.moe_dispatch import route_and_align
from engine.backends.triton.moe_router import _project_route_align_kernel, project_route_and_align
from engine.backends.triton.moe_routing import ROUTE_TILE, SCORINGS
from engine.backends.triton.target import pick
from engine.core.families.moe import Router

CPU = torch.device("cpu")


class GemvLinear(TritonLinear):
    """The linear backend running one row through the GEMV on the CPU too, as on a GPU."""

    gemv_devices = ("cuda", "cpu")


@pytest.mark.interpret
@pytest.mark.parametrize("layout", ["folded", "apart", "no-shared"])
@pytest.mark.parametrize("hashed", [False, True], ids=["noaux", "hash"])
@pytest.mark.parametrize("experts,hidden,dtype", [(60, 96, torch.bfloat16), (16, 128, torch.float32)])
def test_projection_and_dispatch_equal_gemv_then_dispatch(seed, poisoned_empty, layout, hashed, experts, hidden,
                                                          dtype):
    """60 experts: eight bands of 8, the last short, and K past the last full step (96 of 64); 16
    experts in two bands over whole steps. The shared expert folded as the stack's last, in a stack
    of its own, or none."""
    cfg = v4_routing(experts, 4, hashed, layout != "no-shared", weight_dtype=dtype)
    if layout == "apart":
        cfg = dataclasses.replace(cfg, shared_expert=0)
    stack = experts + (layout == "folded")
    dispatch = dict(num_experts=stack, block_m=4, shared_block_m=2 if layout == "apart" else None,
                    arrival_counts=3, shared_arrival_counts=2 if layout == "apart" else None)
    x = activations(1, hidden, dtype, scale=2.0)
    gate = (torch.randn(experts, hidden) / hidden**0.5).to(dtype)
    input_ids = torch.randint(50, (1,))
    weights, ids, blocks, shared = project_route_and_align(x, gate, cfg, input_ids, **dispatch)
    want_w, want_ids, want_blocks, want_shared = route_and_align(gemv(x, gate), cfg, input_ids, **dispatch)
    assert torch.equal(weights, want_w) and torch.equal(ids, want_ids)
    same_blocks(blocks, want_blocks)
    assert not blocks.counters.any()
    if layout == "apart":
        same_blocks(shared, want_shared)
        assert not shared.counters.any()
    assert arrival_counters(1, CPU)[0] == 0  # left at 0 for the next launch


def test_projection_takes_one_row_of_its_dtype():
    cfg = v4_routing(8, 2, False, True)
    gate = torch.randn(8, 64)
    for x in (torch.randn(2, 64), torch.randn(1, 64, dtype=torch.bfloat16)):
        with pytest.raises(ValueError, match="project and dispatch apart"):
            project_route_and_align(x, gate, cfg, None, 9, 4)


@pytest.mark.interpret
@pytest.mark.parametrize("tokens", [1, 3])
def test_route_experts_given_the_router(seed, poisoned_empty, monkeypatch, tokens):
    """DeepSeek-V4's layer, the shared expert folded: given the router, the same to the bit as given its
    logits (the GEMV's for one row); one row projects in the dispatch's launch (the dispatch alone is
    never launched), more rows dispatch the logits the linear backend computed."""
    experts, hidden, inner, dtype = 8, 64, 64, torch.bfloat16
    cfg = v4_routing(experts, 2, False, True, weight_dtype=dtype)
    w = random_experts(experts + 1, hidden, inner, dtype, swiglu_limit=1.0)
    router = Router((torch.randn(experts, hidden) / hidden**0.5).to(dtype), GemvLinear(None))
    x = activations(tokens, hidden, dtype, scale=2.0)
    moe = TritonMoE(None)
    want = moe.route_experts(x, router.logits(x), cfg, w)
    if tokens == 1:
        monkeypatch.setattr(triton_moe, "route_and_align", None)  # a call would fail
    got = moe.route_experts(x, router, cfg, w)
    assert not got.isnan().any() and torch.equal(got, want)


@pytest.mark.aot
@pytest.mark.parametrize("target", ["sm_90", "sm_100", "gfx942", "gfx950"])
@pytest.mark.parametrize("hashed", [False, True], ids=["noaux", "hash"])
def test_projection_and_dispatch_compile(target, hashed):
    """DeepSeek-V4-Flash's router (256 experts of hidden 4096, bf16) in the GEMV's bands and warps,
    the routing of one token (top-6 and the shared expert folded) in the last program: no spills on
    sm_90, no scratch on AMD; the arrival an acq_rel atomic at GPU scope; PDL on NVIDIA."""
    from aot import GRID_DEPENDENCY, LDS_BYTES, amd_scratch_and_lds, compile_asm, local_memory_ops, pdl

    gemv_cfg, align = pick(GEMV, target).for_shape(1, 4096), pick(ALIGN, target)
    signature = {**ROUTING_SIGNATURE, "logits_ptr": "*bf16", "x_ptr": "*bf16", "gate_ptr": "*bf16",
                 "tickets_ptr": "*i32", "K": "i32", "stride_gn": "i32"}
    constexprs = dict(SCORING=SCORINGS["sqrtsoftplus"], HAS_BIAS=not hashed, HASHED=hashed, RENORMALIZE=True,
                      TOP_K=6, K_POW2=8, EXPERTS=256, ROUND_TO=tl.bfloat16, SHARED=256, BLOCK_T=1, BLOCK_M=16,
                      STACK_EXPERTS=triton.next_power_of_2(257), SCAN_BLOCKS=align.scan_blocks, SHARED_APART=False,
                      SHARED_BLOCK_M=1, BLOCK_N=gemv_cfg.block_n, BLOCK_K=gemv_cfg.block_k, EVEN_K=True,
                      PDL=pdl(target))
    assert pick(ROUTE_TILE, target)[1] <= gemv_cfg.num_warps  # the routing has at least its own warps
    asm = compile_asm(_project_route_align_kernel, signature, constexprs, target, num_warps=gemv_cfg.num_warps,
                      num_stages=gemv_cfg.num_stages, divisible_by_16=["K", "stride_gn"], sass=target == "sm_90")
    if target.startswith("sm_"):
        assert "atom.global.gpu.acq_rel.add" in asm["ptx"] and all(op in asm["ptx"] for op in GRID_DEPENDENCY)
        if target == "sm_90":
            assert local_memory_ops(asm["sass"]) == 0
    else:
        scratch, lds = amd_scratch_and_lds(asm)
        assert "global_atomic_add" in asm["amdgcn"] and scratch == 0 and lds <= LDS_BYTES[target]


@pytest.mark.gpu
@pytest.mark.parametrize("hashed", [False, True], ids=["noaux", "hash"])
def test_projection_and_dispatch_gpu(seed, hashed):
    """DeepSeek-V4-Flash's router at batch 1 on the GPU: the one launch equals the GEMV and the dispatch
    to the bit, eager and replayed from a CUDA graph on fresh inputs (the counter left at 0 each time)."""
    experts, hidden, vocab = 256, 4096, 1000
    cfg = dataclasses.replace(v4_routing(experts, 6, hashed, True, vocab=vocab, weight_dtype=torch.bfloat16),
                              correction_bias=None if hashed else torch.randn(experts, device="cuda") * 0.1,
                              hash_table=torch.rand(vocab, experts, device="cuda").argsort(-1)[:, :6] if hashed
                              else None)
    dispatch = dict(num_experts=experts + 1, block_m=16, arrival_counts=8)
    x = torch.empty(1, hidden, dtype=torch.bfloat16, device="cuda")
    gate = torch.empty(experts, hidden, dtype=torch.bfloat16, device="cuda")
    input_ids = torch.empty(1, dtype=torch.long, device="cuda")

    def fill():
        x.copy_(torch.randn(1, hidden, device="cuda") * 2)
        gate.copy_(torch.randn(experts, hidden, device="cuda") * hidden**-0.5)
        input_ids.copy_(torch.randint(vocab, (1,), device="cuda"))

    def check(got):
        want = route_and_align(gemv(x, gate), cfg, input_ids, **dispatch)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        same_blocks(got[2], want[2])
        assert not got[2].counters.any()

    fill()
    check(project_route_and_align(x, gate, cfg, input_ids, **dispatch))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = project_route_and_align(x, gate, cfg, input_ids, **dispatch)
    for _ in range(3):
        fill()
        graph.replay()
        check(out)
