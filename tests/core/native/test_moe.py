"""Native routing against HF's router modules, and expert compute against a per-token loop and HF."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from transformers import DeepseekV3Config, Qwen3MoeConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (DeepseekV4Experts, DeepseekV4HashRouter,
                                                                  DeepseekV4TopKRouter)
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts, Qwen3MoeTopKRouter

from engine.core.families.moe import ExpertWeights, RoutingConfig
from engine.core.native.moe import NativeMoE

HIDDEN, TOKENS = 32, 40
moe = NativeMoE(ctx=None)


def by_expert(weights, ids):
    """Order each row by expert id, so routers that return top-k unsorted compare equal."""
    ids, order = ids.sort(dim=-1)
    return weights.gather(1, order), ids


def assert_same_routing(ours, hf):
    (w, i), (hw, hi) = by_expert(*ours), by_expert(*hf)
    assert w.dtype == torch.float32 and i.dtype == torch.int64
    torch.testing.assert_close(i, hi, rtol=0, atol=0)
    torch.testing.assert_close(w, hw.float(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("norm", [True, False])
def test_softmax_topk_matches_qwen3_moe(seed, norm):
    config = Qwen3MoeConfig(hidden_size=HIDDEN, num_experts=16, num_experts_per_tok=4, norm_topk_prob=norm)
    router = Qwen3MoeTopKRouter(config)
    router.weight.data.normal_()
    x = torch.randn(TOKENS, HIDDEN)
    _, hw, hi = router(x)
    cfg = RoutingConfig(num_experts=16, top_k=4, scoring="softmax", renormalize=norm)
    assert_same_routing(moe.route(F.linear(x, router.weight), cfg), (hw, hi))


@pytest.mark.parametrize("norm", [True, False])
def test_grouped_sigmoid_bias_matches_deepseek_v3(seed, norm):
    config = DeepseekV3Config(hidden_size=HIDDEN, n_routed_experts=32, num_experts_per_tok=4, n_group=8,
                              topk_group=3, routed_scaling_factor=2.5, norm_topk_prob=norm)
    router = DeepseekV3TopkRouter(config)
    router.weight.data.normal_()
    router.e_score_correction_bias.uniform_(-0.5, 0.5)
    x = torch.randn(TOKENS, HIDDEN)
    _, hw, hi = router(x)
    cfg = RoutingConfig(num_experts=32, top_k=4, scoring="sigmoid", renormalize=norm, num_groups=8, topk_groups=3,
                        routed_scaling_factor=2.5, correction_bias=router.e_score_correction_bias)
    assert_same_routing(moe.route(F.linear(x, router.weight), cfg), (hw, hi))


def v4_config(**kw):
    return DeepseekV4Config(**{"hidden_size": HIDDEN, "num_local_experts": 16, "num_experts_per_tok": 4,
                               "intermediate_size": 24, "vocab_size": 64, **kw})


def test_sqrtsoftplus_bias_matches_deepseek_v4(seed):
    router = DeepseekV4TopKRouter(v4_config())
    router.weight.data.normal_()
    router.e_score_correction_bias.uniform_(-0.5, 0.5)
    x = torch.randn(TOKENS, HIDDEN)
    _, hw, hi = router(x)
    cfg = RoutingConfig(num_experts=16, top_k=4, scoring="sqrtsoftplus", routed_scaling_factor=1.5,
                        correction_bias=router.e_score_correction_bias)
    assert_same_routing(moe.route(F.linear(x, router.weight), cfg), (hw, hi))


def test_hash_routing_matches_deepseek_v4(seed):
    router = DeepseekV4HashRouter(v4_config())
    router.weight.data.normal_()
    router.tid2eid.copy_(torch.stack([torch.randperm(16)[:4] for _ in range(64)]))
    x, input_ids = torch.randn(TOKENS, HIDDEN), torch.randint(0, 64, (TOKENS,))
    _, hw, hi = router(x, input_ids)
    cfg = RoutingConfig(num_experts=16, top_k=4, scoring="sqrtsoftplus", routed_scaling_factor=1.5,
                        hash_table=router.tid2eid.int())
    assert_same_routing(moe.route(F.linear(x, router.weight), cfg, input_ids), (hw, hi))


def test_bias_chooses_but_does_not_weigh(seed):
    logits = torch.randn(TOKENS, 8)
    bias = torch.zeros(8)
    bias[5] = 10.0
    w, ids = moe.route(logits, RoutingConfig(num_experts=8, top_k=2, scoring="sigmoid", renormalize=False,
                                             correction_bias=bias))
    assert (ids == 5).any(dim=-1).all()
    torch.testing.assert_close(w, logits.sigmoid().gather(1, ids))


def test_group_score_is_top2_sum_with_bias_else_max():
    """Group 0 has the best single expert, group 1 the best pair: the rule decides which group wins."""
    probs = torch.tensor([[0.9, 0.01, 0.01, 0.01, 0.6, 0.6, 0.01, 0.01]])
    cfg = dict(num_experts=8, top_k=1, scoring="sigmoid", renormalize=False, num_groups=2, topk_groups=1)
    _, ids = moe.route(probs.logit(), RoutingConfig(**cfg))
    assert ids.tolist() == [[0]]
    _, ids = moe.route(probs.logit(), RoutingConfig(**cfg, correction_bias=torch.zeros(8)))
    assert ids.tolist() == [[4]] or ids.tolist() == [[5]]


@pytest.mark.parametrize("routing", [
    dict(scoring="softmax"),
    dict(scoring="sqrtsoftplus", routed_scaling_factor=1.5, bias=True, weight_dtype=torch.bfloat16),
    dict(scoring="sqrtsoftplus", routed_scaling_factor=1.5, hashed=True),
    dict(scoring="sigmoid", num_groups=4, topk_groups=2, bias=True),
], ids=["softmax", "v4-noaux-bf16", "v4-hash", "grouped"])
@pytest.mark.parametrize("shared", [0, 16])
def test_shared_expert_is_a_column_after_the_top_k(seed, routing, shared):
    """DeepSeek-V4's shared expert (in its own stack at 0, or folded after 16 routed ones): the
    routing without it, exactly, then weight 1 and the shared id in every row; not renormalised in."""
    routing = dict(routing)
    bias, hashed = routing.pop("bias", False), routing.pop("hashed", False)
    input_ids = torch.randint(0, 64, (TOKENS,))
    cfg = RoutingConfig(num_experts=16, top_k=4, **routing, correction_bias=torch.randn(16) * 0.1 if bias else None,
                        hash_table=torch.rand(64, 16).argsort(-1)[:, :4] if hashed else None)
    logits = torch.randn(TOKENS, 16) * 3
    weights, ids = moe.route(logits, cfg, input_ids)
    with_shared = moe.route(logits, dataclasses.replace(cfg, shared_expert=shared), input_ids)
    assert with_shared[0].dtype == torch.float32 and with_shared[1].dtype == torch.int64
    assert torch.equal(with_shared[0], torch.cat([weights, torch.ones(TOKENS, 1)], dim=1))
    assert torch.equal(with_shared[1], torch.cat([ids, torch.full((TOKENS, 1), shared)], dim=1))


@pytest.mark.parametrize("bad", [-1, 2.0, "0", True])
def test_shared_expert_must_be_an_index(bad):
    with pytest.raises(ValueError, match="shared_expert"):
        RoutingConfig(num_experts=8, top_k=2, shared_expert=bad)


def loop_reference(x, weights, ids, w):
    """Token by token, expert by expert, in fp32."""
    out = torch.zeros(x.shape[0], x.shape[1])
    inter = w.down.shape[-1]
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate = w.gate_up[e, :inter].float() @ x[t].float()
            up = w.gate_up[e, inter:].float() @ x[t].float()
            if w.swiglu_limit is not None:
                gate, up = gate.clamp(max=w.swiglu_limit), up.clamp(-w.swiglu_limit, w.swiglu_limit)
            out[t] += weights[t, j].float() * (w.down[e].float() @ (F.silu(gate) * up))
    return out


def random_experts(num_experts=8, inter=24, dtype=torch.float32, limit=None):
    return ExpertWeights(gate_up=(torch.randn(num_experts, 2 * inter, HIDDEN) / HIDDEN**0.5).to(dtype),
                         down=(torch.randn(num_experts, HIDDEN, inter) / inter**0.5).to(dtype), swiglu_limit=limit)


def random_routing(num_experts=8, top_k=3, tokens=TOKENS):
    return moe.route(torch.randn(tokens, num_experts), RoutingConfig(num_experts=num_experts, top_k=top_k))


@pytest.mark.parametrize("limit", [None, 0.3])
def test_experts_match_loop(seed, limit):
    w = random_experts(limit=limit)
    x = torch.randn(TOKENS, HIDDEN) * 3
    weights, ids = random_routing()
    out = moe.experts(x, weights, ids, w)
    assert out.dtype == x.dtype and out.shape == x.shape
    torch.testing.assert_close(out, loop_reference(x, weights, ids, w), rtol=1e-5, atol=1e-5)


def test_experts_bf16(seed):
    w = random_experts(dtype=torch.bfloat16)
    x = torch.randn(TOKENS, HIDDEN).bfloat16()
    weights, ids = random_routing(tokens=TOKENS)
    out = moe.experts(x, weights, ids, w)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), loop_reference(x, weights, ids, w), rtol=3e-2, atol=3e-2)


def test_few_tokens_leave_experts_unused(seed):
    w = random_experts(num_experts=16)
    x = torch.randn(2, HIDDEN)
    weights, ids = random_routing(num_experts=16, top_k=2, tokens=2)
    torch.testing.assert_close(moe.experts(x, weights, ids, w), loop_reference(x, weights, ids, w),
                               rtol=1e-5, atol=1e-5)


def test_experts_match_qwen3_moe(seed):
    config = Qwen3MoeConfig(hidden_size=HIDDEN, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=24)
    hf = Qwen3MoeExperts(config)
    w = random_experts()
    hf.gate_up_proj.data.copy_(w.gate_up)
    hf.down_proj.data.copy_(w.down)
    x = torch.randn(TOKENS, HIDDEN)
    weights, ids = random_routing()
    with torch.no_grad():
        expected = hf(x, ids, weights)
    torch.testing.assert_close(moe.experts(x, weights, ids, w), expected, rtol=1e-5, atol=1e-5)


def test_experts_match_deepseek_v4_clamp(seed):
    config = v4_config(num_local_experts=8, num_experts_per_tok=3, swiglu_limit=0.4)
    hf = DeepseekV4Experts(config)
    w = random_experts(limit=0.4)
    hf.gate_up_proj.data.copy_(w.gate_up)
    hf.down_proj.data.copy_(w.down)
    x = torch.randn(TOKENS, HIDDEN) * 3
    weights, ids = random_routing()
    with torch.no_grad():
        expected = hf(x, ids, weights)
    out = moe.experts(x, weights, ids, w)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    unclamped = moe.experts(x, weights, ids, ExpertWeights(w.gate_up, w.down))
    assert not torch.allclose(out, unclamped, rtol=1e-3, atol=1e-3), "the clamp never bit"


@pytest.mark.gpu
def test_cuda_matches_cpu(seed):
    bias = torch.randn(32) * 0.1
    cfg = RoutingConfig(num_experts=32, top_k=4, scoring="sigmoid", num_groups=4, topk_groups=2,
                        routed_scaling_factor=2.5, correction_bias=bias)
    logits = torch.randn(TOKENS, 32)
    weights, ids = moe.route(logits, cfg)
    cuda_cfg = RoutingConfig(**{**cfg.__dict__, "correction_bias": bias.cuda()})
    cw, ci = moe.route(logits.cuda(), cuda_cfg)
    assert_same_routing((cw.cpu(), ci.cpu()), (weights, ids))
    w = random_experts(num_experts=32, limit=1.0)
    x = torch.randn(TOKENS, HIDDEN)
    expected = moe.experts(x, weights, ids, w)
    cuda_w = ExpertWeights(w.gate_up.cuda(), w.down.cuda(), swiglu_limit=1.0)
    out = moe.experts(x.cuda(), weights.cuda(), ids.cuda(), cuda_w)
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-4, atol=1e-4)
