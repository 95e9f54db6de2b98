"""DSpark with a tiny random DeepSeek-V4.1's own stages (its ``mtp.*`` tensors, no drafter
directory): they load under their published names, the context and a batch of blocks equal the
stages written out here, drafts are proposed and verified, greedy output
equals decoding without speculation over chunked prefill and a prefix hit, every page comes back;
a config whose dspark_* keys disagree with the tensors, or a checkpoint without stages, is refused
at start-up with the reason. The random stages' drafts are mostly rejected; the memory-bound curve
verifies every one."""

from __future__ import annotations

import json
import random

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from engine import LLM
from engine.core.native.mhc import hc_head, hc_post, hc_pre
from engine.core.native.tail_rope import rotate_tail
from engine.core.spec.config import SpecConfigError
from engine.core.spec.dspark.stages import StageDrafter
from engine.core.spec.verify_length import LoadAwareLength, StepCurve
from dsv41_random import KERNEL_SHAPE, random_v41_checkpoint, v41_config
from test_spec_decode import PAGE, assert_clean, completions, greedy

# CSA2 ratio 2 and 1 groups, the candidate filter; three stages reading the last three layers
TINY = dict(ratios=[0, 2, 2, 1, 1], kv_sources=[1, 3], index_sources=[1, 3, 4], candidate=3, blocks=2, block_size=2,
            dspark=[2, 3, 4])
SPEC = {"method": "dspark", "num_speculative_tokens": 4}


def make(path, spec: bool, **kw) -> LLM:
    opts = dict(dtype="float32", page_size=PAGE, num_pages=200, chunked_prefill_size=8, max_num_seqs=4,
                progress=False, speculative_config=SPEC if spec else None)
    llm = LLM(str(path), **{**opts, **kw})
    if spec:  # every step costs the same: every draft verified
        llm.engine.speculator.verify_length = LoadAwareLength(StepCurve((1, 64), (1.0, 1.0)), 4)
    return llm


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, run_seed, shared_dir):
    return random_v41_checkpoint(tmp_path_factory.mktemp("v41-dspark"), run_seed, v41_config(**TINY),
                                 shared_dir / "models" / "tiny-dsv4-py")


@pytest.fixture(scope="module")
def pair(tiny):
    """(decoding without speculation, with the checkpoint's DSpark stages)"""
    return make(tiny, False, enable_prefix_caching=False), make(tiny, True)


def prompts_for(n: int, length: int) -> list[list[int]]:
    return [[random.randrange(4, 128) for _ in range(length)] for _ in range(n)]


def test_the_stages_load_under_their_published_names(tiny, pair):
    drafter = pair[1].engine.speculator.proposer.drafter
    assert isinstance(drafter, StageDrafter) and pair[1].engine.speculator.proposer.feature_layers == (2, 3, 4)
    published = {"mtp.0.main_proj.weight": drafter.main_proj.weight, "mtp.0.main_norm.weight": drafter.main_norm.weight,
                 "mtp.1.attn.wq_a.weight": drafter.stages[1].attn.wq_a.weight,
                 "mtp.2.ffn.gate.bias": drafter.stages[2].ffn.gate.bias, "mtp.2.norm.weight": drafter.norm.weight,
                 "mtp.2.hc_head_fn": drafter.hc_head.hc_fn,
                 "mtp.2.markov_head.markov_w1.weight": drafter.markov_w1.weight,
                 "mtp.2.markov_head.markov_w2.weight": drafter.markov_w2.weight,
                 "mtp.2.confidence_head.proj.weight": drafter.confidence.weight}
    with safe_open(str(tiny / "model.safetensors"), "pt") as f:
        for name, param in published.items():
            assert f.get_tensor(name).equal(param.detach()), name
        experts = f.get_tensor("mtp.0.ffn.experts.3.w2.weight")
    assert drafter.stages[0].ffn.gate.weight.shape[0] == 4 and drafter.stages[0].ffn.top_k == 2
    assert experts.equal(drafter.stages[0].ffn.experts.down[3])


def test_the_context_is_the_fused_mean_of_each_target_layers_streams(pair, seed):
    """Each stage's context head: main_norm(main_proj(the three layers' streams, each averaged)),
    through the stage's wkv and KV norm, rotated on its trailing channels at the context's positions."""
    drafter = pair[1].engine.speculator.proposer.drafter
    n, streams, d = random.randint(1, 9), 2, 32
    features = torch.randn(n, 3 * streams * d)
    positions = torch.randint(0, 100, (n,))
    fused = F.rms_norm(features.view(n, 3, streams, d).mean(2).flatten(1) @ drafter.main_proj.weight.T, (d,),
                       drafter.main_norm.weight, drafter.main_norm.eps)
    for stage, (k, v) in zip(drafter.stages, drafter.context_kv(features, positions)):
        a = stage.attn
        latent = F.rms_norm(fused @ a.wkv.weight.T, (a.head_dim,), a.norm.weight, a.eps)
        want = rotate_tail(latent, a.rope.cos[positions], a.rope.sin[positions])
        torch.testing.assert_close(k[:, 0], want, rtol=1e-5, atol=1e-5)
        assert v is k


def _attention(stage, x: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """V4's attention written out for one block ``x`` [Q, D] over the context's ``keys`` [C, hd]
    and its own: per-head query norm, trailing-channel RoPE undone on the output, sinks, grouped wo_a."""
    a = stage.attn
    heads, hd, eps = a.num_heads, a.head_dim, a.eps
    cos, sin = a.rope.cos[positions], a.rope.sin[positions]
    q = F.linear(F.rms_norm(F.linear(x, a.wq_a.weight), (a.q_norm.weight.numel(),), a.q_norm.weight, eps),
                 a.wq_b.weight).view(-1, heads, hd)
    q = rotate_tail(F.rms_norm(q, (hd,), eps=eps), cos[:, None], sin[:, None])
    own = rotate_tail(F.rms_norm(F.linear(x, a.wkv.weight), (hd,), a.norm.weight, eps), cos, sin)
    keys = torch.cat([keys, own])
    scores = torch.einsum("qhd,ld->hql", q, keys) * hd ** -0.5
    sink = a.attn_sink.view(heads, 1, 1).expand(-1, q.shape[0], 1)
    probs = torch.cat([scores, sink], -1).softmax(-1)[..., :-1]
    out = rotate_tail(torch.einsum("hql,ld->qhd", probs, keys), cos[:, None], -sin[:, None])
    out = out.reshape(x.shape[0], a.groups, -1)
    wo_a = a.wo_a.weight.view(a.groups, a.o_rank, -1)
    return F.linear(torch.einsum("qgi,gri->qgr", out, wo_a).flatten(1), a.wo_b.weight)


def _block(drafter, ids: torch.Tensor, positions: torch.Tensor, context: list[torch.Tensor]) -> torch.Tensor:
    """One sequence's block through the stages (mHC by core/native's oracle, the MoE the stage's own)."""
    streams = drafter._target[0](ids).unsqueeze(1).expand(-1, 2, -1)
    for stage, keys in zip(drafter.stages, context):
        for name, norm, sublayer in (("attn", stage.attn_norm, lambda x: _attention(stage, x, positions, keys)),
                                     ("ffn", stage.ffn_norm, lambda x: stage.ffn(x, ids))):
            w = stage._mix(name)
            x, post, comb = hc_pre(streams, w.fn, w.base, w.scale, w.norm_eps, w.hc_eps, w.sinkhorn_iters)
            x = F.rms_norm(x, (x.shape[-1],), norm.weight, norm.eps)
            streams = hc_post(sublayer(x), streams, post, comb)
    h = drafter.hc_head
    x = hc_head(streams, h.hc_fn, h.hc_base, h.hc_scale, h.eps, h.hc_eps)
    return F.rms_norm(x, (x.shape[-1],), drafter.norm.weight, drafter.norm.eps)


def test_a_batch_of_blocks_is_each_block_written_out(pair, seed):
    """Each sequence's block (the anchor, then the noise token) over its own valid context rows
    only, against the stages written out in the test."""
    drafter = pair[1].engine.speculator.proposer.drafter
    lengths = [random.randint(1, 12) for _ in range(3)]
    width = max(lengths)
    with torch.inference_mode():
        context = drafter.context_kv(torch.randn(3 * width, 3 * 2 * 32), torch.arange(width).repeat(3))
        context = [(k.view(3, width, 1, -1), v.view(3, width, 1, -1)) for k, v in context]
        valid = torch.arange(width) < torch.tensor(lengths)[:, None]
        anchors = torch.randint(4, 128, (3,))
        got = drafter.block(anchors, torch.tensor(lengths), context, valid)
        for i, n in enumerate(lengths):
            ids = torch.tensor([int(anchors[i])] + [3] * 4)
            want = _block(drafter, ids, torch.arange(n, n + 5), [k[i, :n, 0] for k, _ in context])
            torch.testing.assert_close(got[i], want, rtol=1e-4, atol=1e-4)


def test_greedy_equals_decoding_without_drafts_over_chunks_and_a_prefix_hit(pair, seed):
    plain, spec = pair
    prompts = prompts_for(2, random.randint(9, 20)) + prompts_for(1, random.randint(21, 30))
    params = greedy(random.randint(6, 10))
    want = plain.generate(prompts, params)
    counters = spec.engine.speculator.counters
    before = counters.num_draft_tokens
    assert completions(spec.generate(prompts, params)) == completions(want)
    assert counters.num_draft_tokens > before  # proposed and verified (a draft only counts once verified)
    before = counters.num_draft_tokens
    again = spec.generate(prompts, params)  # every prompt hits the prefix cache: drafted from the hit's end on
    assert all(o.num_cached_tokens > 0 for o in again) and counters.num_draft_tokens > before
    assert completions(again) == completions(want)
    assert_clean(spec, [o.prompt_token_ids + c.token_ids for o in want for c in o.outputs])
    assert not spec.engine.speculator.proposer._contexts


def _with(tiny, tmp_path, **fields):
    """The tiny checkpoint's tensors under a config.json with ``fields`` changed."""
    path = tmp_path / "_".join(fields)
    path.mkdir()
    for f in tiny.iterdir():
        (path / f.name).symlink_to(f)
    (path / "config.json").unlink()
    (path / "config.json").write_text(json.dumps({**json.loads((tiny / "config.json").read_text()), **fields}))
    return path


def refused(path, spec=SPEC) -> str:
    with pytest.raises(SpecConfigError, match=f"speculative_config.method: '{spec['method']}' cannot run here") as err:
        LLM(str(path), speculative_config=spec, progress=False, num_pages=64, dtype="float32")
    return str(err.value)


@pytest.mark.parametrize("fields, reason", [
    ({"dspark_target_layer_ids": [2, 3, 5]}, "dspark_target_layer_ids: [2, 3, 5] must be target layers in [0, 5)"),
    ({"dspark_target_layer_ids": [3, 4]}, "dspark_target_layer_ids: [3, 4] makes mtp.0.main_proj.weight (32, 64), "
                                          "but the checkpoint's is (32, 96)"),
    ({"dspark_markov_rank": 16}, "dspark_markov_rank: 16 makes mtp.2.markov_head.markov_w1.weight (128, 16)"),
    ({"dspark_n_routed_experts": 6}, "dspark_n_routed_experts: 6, but the checkpoint's stages have 4 routed experts"),
    ({"dspark_block_size": 3}, "num_speculative_tokens: 4 is more than the checkpoint's block of 3 "
                               "(dspark_block_size)"),
    ({"num_nextn_predict_layers": 2}, "num_nextn_predict_layers: 2, but the checkpoint's mtp.* tensors are stages "
                                      "[0, 1, 2]"),
])
def test_dspark_keys_that_disagree_with_the_tensors_are_refused_naming_the_field(tiny, tmp_path, fields, reason):
    assert reason in refused(_with(tiny, tmp_path, **fields))


def test_a_checkpoint_without_stages_is_refused_with_the_reason(tiny, tmp_path, shared_dir):
    v4 = shared_dir / "models" / "tiny-dsv4-py"
    assert "DSpark needs a drafter directory" in refused(v4)
    assert "which this one has not" in refused(v4)
    bare = tmp_path / "bare"  # V4.1 dspark_* keys, no mtp.* tensors
    random_v41_checkpoint(bare, 0, {**v41_config(**{**TINY, "dspark": []}), **{
        k: v for k, v in json.loads((tiny / "config.json").read_text()).items() if k.startswith("dspark_")}},
        shared_dir / "models" / "tiny-dsv4-py")
    assert "has no mtp.* tensors: it has no DSpark stages to draft with" in refused(bare)
    assert "are DSpark stages" in refused(tiny, {"method": "mtp", "num_speculative_tokens": 1})


@pytest.mark.gpu
def test_on_cuda_greedy_equals_decoding_without_drafts_over_chunks_and_a_prefix_hit(tmp_path, shared_dir, seed):
    """The stages on CUDA beside the target on the Triton V4 attention (its head dims), fp32, graphs captured."""
    path = random_v41_checkpoint(tmp_path / "v41", seed, {**v41_config(**TINY), **KERNEL_SHAPE},
                                 shared_dir / "models" / "tiny-dsv4-py")
    plain, spec = make(path, False, device="cuda", enable_prefix_caching=False), make(path, True, device="cuda")
    prompts = prompts_for(2, random.randint(9, 20)) + prompts_for(1, random.randint(21, 30))
    want = completions(plain.generate(prompts, greedy(10)))
    assert completions(spec.generate(prompts, greedy(10))) == want
    again = spec.generate(prompts, greedy(10))
    assert all(o.num_cached_tokens > 0 for o in again) and completions(again) == want
    assert spec.engine.speculator.counters.num_draft_tokens > 0
