"""The routing kernel against ``NativeMoE.route``, and routing + experts captured in a CUDA graph.

Fresh random logits every run. Expert ids must equal native's exactly wherever the choice has no
near tie (two of the k+1 best choice scores within 1e-5 relative, where the kernel's and torch's
fp32 roundings may order them differently); such tokens are left out of the id check and counted.
Weights must be within a few fp32 ulps. A shared expert's column (weight 1, its id) comes from the
same launch, checked on outputs that start as poison.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import triton.language as tl

from engine.backends.triton.moe import TritonMoE
from engine.backends.triton.moe_routing import ROUTE_TILE, SCORINGS, _route_kernel, route
from engine.backends.triton.target import pick
from engine.core.families.moe import RoutingConfig
from engine.core.native.moe import NativeMoE

NEAR = 1e-5


def choice_scores(logits: torch.Tensor, cfg: RoutingConfig) -> torch.Tensor:
    scores = {"softmax": lambda x: x.softmax(-1), "sigmoid": torch.sigmoid,
              "sqrtsoftplus": lambda x: torch.nn.functional.softplus(x).sqrt()}[cfg.scoring](logits.float())
    return scores if cfg.correction_bias is None else scores + cfg.correction_bias


def clear_of_ties(logits: torch.Tensor, cfg: RoutingConfig) -> torch.Tensor:
    """Tokens whose k+1 best choice scores are pairwise more than NEAR (relative) apart."""
    if cfg.hash_table is not None:
        return torch.ones(logits.shape[0], dtype=torch.bool)
    best = choice_scores(logits, cfg).topk(min(cfg.top_k + 1, cfg.num_experts), dim=-1).values
    gaps = (best[:, :-1] - best[:, 1:]) / best[:, :-1].abs().clamp_min(1e-30)
    return (gaps > NEAR).all(dim=-1)


def check_route(logits, cfg, input_ids=None):
    got_w, got_ids = route(logits, cfg, input_ids)
    ref_w, ref_ids = NativeMoE(None).route(logits, cfg, input_ids)
    assert got_w.dtype == torch.float32 and got_ids.dtype == torch.int64 and got_ids.shape == ref_ids.shape
    clear = clear_of_ties(logits, cfg)
    assert clear.float().mean() > 0.5, "too many near ties to check anything"
    assert torch.equal(got_ids[clear], ref_ids[clear])
    torch.testing.assert_close(got_w[clear], ref_w[clear], rtol=2e-6, atol=1e-7)


def config(scoring, experts, top_k, bias, scaling=1.0, renormalize=True, hash_table=None, weight_dtype=torch.float32):
    return RoutingConfig(num_experts=experts, top_k=top_k, scoring=scoring, renormalize=renormalize,
                         routed_scaling_factor=scaling, correction_bias=torch.randn(experts) * 0.1 if bias else None,
                         hash_table=hash_table, weight_dtype=weight_dtype)


@pytest.mark.interpret
@pytest.mark.parametrize("scoring", sorted(SCORINGS))
@pytest.mark.parametrize("tokens,experts,top_k", [(1, 8, 2), (37, 16, 4), (5, 256, 6), (9, 60, 8)])
@pytest.mark.parametrize("bias", [False, True])
def test_route_matches_native(seed, scoring, tokens, experts, top_k, bias):
    cfg = config(scoring, experts, top_k, bias, scaling=1.5)
    check_route(untied_logits(tokens, experts, cfg), cfg)


def untied_logits(tokens: int, experts: int, cfg: RoutingConfig) -> torch.Tensor:
    """Random logits whose rows are all clear of near ties, rows redrawn until they are: sigmoid
    over 256 experts saturates at the top, where a row of 5 ties often (CI once had 3 of 5 tied)."""
    logits = torch.randn(tokens, experts) * 3
    for _ in range(100):
        tied = ~clear_of_ties(logits, cfg)
        if not tied.any():
            return logits
        logits[tied] = torch.randn(int(tied.sum()), experts) * 3
    raise AssertionError("no logits clear of near ties in 100 draws")


@pytest.mark.interpret
def test_route_without_renormalising_and_extreme_logits(seed):
    """Logits past softplus's threshold and far below zero, where log(1 + e**x) loses e**x."""
    logits = torch.randn(20, 32) * 3
    logits[:, :4] = torch.rand(20, 4) * 10 + 20
    logits[:, 4:12] = -(torch.rand(20, 8) * 30 + 20)
    check_route(logits, config("sqrtsoftplus", 32, 6, True, renormalize=False))
    check_route(logits[:, 4:12].contiguous(), config("sqrtsoftplus", 8, 2, False, scaling=2.5))


@pytest.mark.interpret
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float16])
def test_weights_rounded_to_the_activations_dtype(seed, weight_dtype):
    """DeepSeek-V4 weighs expert outputs in x's dtype: the weights come out rounded to it, in fp32."""
    logits = torch.randn(11, 16) * 3
    cfg = config("sqrtsoftplus", 16, 4, True, scaling=1.5, weight_dtype=weight_dtype)
    weights, ids = route(logits, cfg)
    ref_w, ref_ids = NativeMoE(None).route(logits, cfg)
    clear = clear_of_ties(logits, cfg)
    assert torch.equal(ids[clear], ref_ids[clear])
    # both round their fp32 weight, which may differ by an fp32 ulp and so round a step apart
    torch.testing.assert_close(weights[clear], ref_w[clear], rtol=torch.finfo(weight_dtype).eps, atol=0)
    for w in (weights, ref_w):
        assert w.dtype == torch.float32 and torch.equal(w, w.to(weight_dtype).float())
    unrounded = route(logits, dataclasses.replace(cfg, weight_dtype=torch.float32))[0]
    assert not torch.equal(weights, unrounded)


@pytest.mark.interpret
@pytest.mark.parametrize("tokens", [1, 30])
def test_hash_routing_by_token_id(seed, tokens):
    vocab, experts, top_k = 50, 16, 3
    table = torch.rand(vocab, experts).argsort(-1)[:, :top_k]
    logits = torch.randn(tokens, experts)
    input_ids = torch.randint(vocab, (tokens,))
    check_route(logits, config("sqrtsoftplus", experts, top_k, False, 1.5, hash_table=table), input_ids)


@pytest.mark.interpret
@pytest.mark.parametrize("hashed", [False, True], ids=["noaux", "hash"])
@pytest.mark.parametrize("shared", [None, 0, 16], ids=["no-shared", "shared-apart", "shared-folded"])
@pytest.mark.parametrize("top_k", [3, 4])
def test_shared_expert_column(seed, poisoned_empty, hashed, shared, top_k):
    """DeepSeek-V4's routing (sqrtsoftplus with the no-aux bias, or hash by token id) with its shared
    expert's column (id 0 in a stack of its own, 16 folded after the routed experts) and without:
    native's routing, and the column weight 1 and the shared id; the routed columns are those of the
    routing without it, to the bit."""
    tokens, experts, vocab = 21, 16, 50
    table = torch.rand(vocab, experts).argsort(-1)[:, :top_k] if hashed else None
    cfg = dataclasses.replace(config("sqrtsoftplus", experts, top_k, not hashed, 1.5, hash_table=table),
                              shared_expert=shared)
    logits, input_ids = torch.randn(tokens, experts) * 3, torch.randint(vocab, (tokens,))
    check_route(logits, cfg, input_ids)
    weights, ids = route(logits, cfg, input_ids)
    assert weights.shape == ids.shape == (tokens, top_k + (shared is not None))
    assert not weights.isnan().any() and not (ids == -7).any()
    if shared is not None:
        assert (weights[:, top_k] == 1).all() and (ids[:, top_k] == shared).all()
        routed = route(logits, dataclasses.replace(cfg, shared_expert=None), input_ids)
        assert torch.equal(weights[:, :top_k], routed[0]) and torch.equal(ids[:, :top_k], routed[1])


@pytest.mark.interpret
def test_strided_logits_and_no_tokens(seed):
    wide = torch.randn(7, 40)
    check_route(wide[:, 4:36], config("softmax", 32, 4, False))
    weights, ids = route(torch.zeros(0, 8), config("softmax", 8, 2, False))
    assert weights.shape == ids.shape == (0, 2)


def test_grouped_routing_stays_native(seed):
    logits = torch.randn(9, 16)
    cfg = RoutingConfig(num_experts=16, top_k=4, scoring="sigmoid", num_groups=4, topk_groups=2,
                        correction_bias=torch.randn(16))
    for got, ref in zip(TritonMoE(None).route(logits, cfg), NativeMoE(None).route(logits, cfg)):
        assert torch.equal(got, ref)


def test_route_refuses_bad_input():
    with pytest.raises(ValueError, match="hash routing needs the token ids"):
        route(torch.zeros(2, 8), config("softmax", 8, 2, False, hash_table=torch.zeros(4, 2, dtype=torch.long)))
    with pytest.raises(ValueError, match="scoring"):
        route(torch.zeros(2, 8), config("relu", 8, 2, False))
    with pytest.raises(ValueError, match="8 experts"):
        route(torch.zeros(2, 8), config("softmax", 16, 2, False))


# GPU: routing and experts in a CUDA graph, replayed on new inputs


@pytest.mark.gpu
@pytest.mark.parametrize("hashed", [False, True])
def test_routing_and_experts_replay_in_a_cuda_graph(seed, hashed):
    """DeepSeek-V4-Flash's routing (256 experts, top-6, sqrtsoftplus, bias or hash) and a quarter of its
    experts, captured once; each replay on fresh logits, tokens and ids equals the eager run to the bit."""
    from test_triton_moe import activations, random_experts

    tokens, experts, top_k, hidden, inner, vocab = 16, 64, 6, 1024, 512, 1000
    table = torch.rand(vocab, experts, device="cuda").argsort(-1)[:, :top_k]
    cfg = RoutingConfig(num_experts=experts, top_k=top_k, scoring="sqrtsoftplus", routed_scaling_factor=1.5,
                        correction_bias=None if hashed else torch.randn(experts, device="cuda") * 0.1,
                        hash_table=table if hashed else None)
    w = random_experts(experts, hidden, inner, torch.bfloat16, "cuda", swiglu_limit=10.0)
    moe = TritonMoE(None)
    logits = torch.empty(tokens, experts, device="cuda")
    x = torch.empty(tokens, hidden, dtype=torch.bfloat16, device="cuda")
    input_ids = torch.empty(tokens, dtype=torch.long, device="cuda")

    def step():
        weights, ids = moe.route(logits, cfg, input_ids)
        return moe.experts(x, weights, ids, w), ids

    def fill():
        logits.copy_(torch.randn(tokens, experts, device="cuda") * 3)
        x.copy_(activations(tokens, hidden, torch.bfloat16, "cuda", scale=2.0))
        input_ids.copy_(torch.randint(vocab, (tokens,), device="cuda"))

    fill()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compiles every kernel outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, ids = step()
    for _ in range(3):
        fill()
        graph.replay()
        want_out, want_ids = step()
        assert torch.equal(ids, want_ids) and torch.equal(out, want_out)


# ahead-of-time compilation


@pytest.mark.aot
@pytest.mark.parametrize("target", ["sm_90", "sm_100", "gfx942", "gfx950"])
@pytest.mark.parametrize("hashed", [False, True])
@pytest.mark.parametrize("shared", [-1, 256])
def test_route_kernel_compiles(target, hashed, shared):
    from aot import GRID_DEPENDENCY, compile_asm, pdl

    tile, num_warps = pick(ROUTE_TILE, target)
    signature = {"logits_ptr": "*fp32", "bias_ptr": "*fp32", "table_ptr": "*i64", "token_ids_ptr": "*i64",
                 "weights_ptr": "*fp32", "ids_ptr": "*i64", "T": "i32", "E": "i32", "stride_l": "i32",
                 "scaling": "fp32"}
    constexprs = dict(SCORING=SCORINGS["sqrtsoftplus"], HAS_BIAS=not hashed, HASHED=hashed, RENORMALIZE=True,
                      TOP_K=6, K_POW2=8, EXPERTS=256, BLOCK_T=tile // 256, ROUND_TO=tl.bfloat16,
                      SHARED=shared, PDL=pdl(target))
    asm = compile_asm(_route_kernel, signature, constexprs, target, num_warps=num_warps)
    text = asm.get("ptx") or asm["amdgcn"]
    assert ("sqrt.rn.f32" in text) if target.startswith("sm_") else ("v_sqrt_f32" in text or "v_rsq" in text)
    if target.startswith("sm_"):
        assert all(op in asm["ptx"] for op in GRID_DEPENDENCY)
