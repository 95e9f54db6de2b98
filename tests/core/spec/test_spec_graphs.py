"""Speculative decoding through captured graphs, on the CPU with the graphs backend that records
torch operations: MTP and DSpark (whose steps ask for the target's features), a draft model and
n-gram lookup, greedy output identical to the eager engine without speculation, drafts rejected
and their KV rolled back. Verify steps (K+1 tokens a sequence) replay the verify graphs where the
target's backends are graph-safe (tiny-qwen3-py on the native ones), else the prefill graphs
(tiny-dsv4-py: the native V4 attention and MoE read the host)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import LLM
from engine.core.spec.ngram import lookup
from test_spec_decode import PAGE, assert_clean, greedy, repetitive

ASSETS = Path(__file__).parents[2] / "assets"
OPTS = dict(dtype="float32", page_size=PAGE, num_pages=400, chunked_prefill_size=16, max_num_batched_tokens=32,
            max_num_seqs=4, max_model_len=128, progress=False)
K = 3
CASES = {  # method: (target, speculative_config beyond the method and K)
    "mtp": ("tiny-dsv4-py", {"model": str(ASSETS / "tiny-dsv4-py-mtp")}),
    "dspark": ("tiny-dsv4-py", {"model": str(ASSETS / "tiny-dsv4-py-dspark")}),
    "draft_model": ("tiny-dsv4-py", {"model": "tiny-qwen3-py"}),
    "ngram": ("tiny-qwen3-py", {"prompt_lookup_min": 1, "prompt_lookup_max": 3}),
}


@pytest.fixture(scope="module")
def references(shared_dir):
    """Eager engines without speculation, by target."""
    return {name: LLM(str(shared_dir / "models" / name), **OPTS) for name in ("tiny-dsv4-py", "tiny-qwen3-py")}


def speculating(shared_dir, method: str, **kw) -> LLM:
    target, extra = CASES[method]
    if extra.get("model") == "tiny-qwen3-py":
        extra = {**extra, "model": str(shared_dir / "models" / "tiny-qwen3-py")}
    spec = {"method": method, "num_speculative_tokens": K, **extra}
    return LLM(str(shared_dir / "models" / target), speculative_config=spec, **{**OPTS, **kw})


def kept_in_part(reference: LLM, llm: LLM, eval_text: str, params, tries: int = 48) -> tuple[list[int], list[int]]:
    """A prompt, and the reference's greedy output for it, whose first verify step checks K n-gram
    drafts of which the target keeps some but not all (read from that output and the proposer's
    lookup), so its step after the prefill is one of K+1 tokens and a draft is rejected there."""
    spec = CASES["ngram"][1]
    prompts = [repetitive(llm, eval_text) for _ in range(tries)]
    for prompt, out in zip(prompts, reference.generate(prompts, params)):
        target = out.outputs[0].token_ids
        drafts = lookup(prompt + target[:1], spec["prompt_lookup_min"], spec["prompt_lookup_max"], K)
        kept = next((i for i, (d, t) in enumerate(zip(drafts, target[1:])) if d != t), len(drafts))
        if len(drafts) == K and 0 < kept < K:
            return prompt, target
    pytest.fail(f"none of {tries} repetitive prompts has K drafts of which some are kept and some rejected")


@pytest.mark.parametrize("method", list(CASES))
def test_verify_steps_replay_graphs(method, shared_dir, references, eval_text, seed, monkeypatch):
    llm = speculating(shared_dir, method, graph_backend="recorded")
    graphs, runner = llm.engine.runner.prefill_graphs, llm.engine.runner
    assert graphs is not None and graphs.feature == runner.feature
    replays = []  # (query lengths, features asked, through the verify graphs, logits rows)
    real = graphs.run
    monkeypatch.setattr(graphs, "run", lambda batch, *a: replays.append(
        (batch.query_lens_cpu, batch.features is not None, False, batch.logits_indices.numel())) or real(batch, *a))
    whole_steps = CASES[method][0] == "tiny-qwen3-py"
    assert (runner.verify_graphs is not None) == whole_steps
    if whole_steps:
        verify = runner.verify_graphs
        assert verify.query_len == K + 1 and verify.feature == runner.feature
        real_verify = verify.run
        monkeypatch.setattr(verify, "run", lambda ids, ctx, *a: replays.append(
            ([K + 1] * len(ctx), a[-1] is not None, True, len(ids))) or real_verify(ids, ctx, *a))
    handed = []  # the features each step handed the proposer, and a copy taken then: no later replay overwrites them
    execute = runner.execute

    def spied(step):
        out = execute(step)
        if out.features is not None:
            handed.append((out.features, out.features.clone()))
        return out

    monkeypatch.setattr(runner, "execute", spied)
    prompts = [repetitive(llm, eval_text) for _ in range(3)]
    params = greedy(10)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    want = [o.outputs[0].token_ids for o in references[CASES[method][0]].generate(prompts, params)]
    assert got == want
    if whole_steps:  # one sequence alone: a step of K+1 tokens, not mixed with another's prefill
        alone, its_want = kept_in_part(references["tiny-qwen3-py"], llm, eval_text, params)
        assert [o.outputs[0].token_ids for o in llm.generate([alone], params)] == [its_want]
    verifies = [(lens, whole, rows) for lens, _, whole, rows in replays if K + 1 in lens]
    assert verifies, "no verify step replayed a graph"
    # K+1 tokens and logits rows every sequence: a verify graph's where captured (fewer drafts, a
    # decode or a prefill chunk beside: prefill's)
    assert all(whole == whole_steps for lens, whole, rows in verifies if set(lens) == {K + 1} and rows == sum(lens))
    assert not whole_steps or any(whole for _, whole, _ in verifies), "no verify step replayed a verify graph"
    assert all(f == (runner.feature is not None) for _, f, _, _ in replays)
    assert len(handed) == (len(replays) if runner.feature else 0)
    assert all(torch.equal(kept, copy) for kept, copy in handed)
    counters = llm.engine.speculator.counters
    assert 0 < counters.num_accepted_tokens < counters.num_draft_tokens, "no draft both kept and rejected"
    assert_clean(llm, [p + g for p, g in zip(prompts, got)] + ([alone + its_want] if whole_steps else []))


@pytest.mark.gpu
@pytest.mark.parametrize("method", list(CASES))
def test_verify_steps_replay_cuda_graphs(method, shared_dir, eval_text, seed):
    """fp32 on the CUDA backends: greedy output equal to the eager engine without speculation there,
    verify steps replayed from CUDA graphs: the verify graphs where the attention backends take K+1
    queries a sequence (the Triton attention and V4 attention both do), the mixed ones the prefill graphs."""
    eager = LLM(str(shared_dir / "models" / CASES[method][0]), **{**OPTS, "device": "cuda", "enforce_eager": True})
    llm = speculating(shared_dir, method, device="cuda")
    runner = llm.engine.runner
    graphs = runner.prefill_graphs
    assert graphs is not None and graphs.feature == runner.feature
    assert runner.graphs is not None and runner.graphs.feature == runner.feature  # one-token steps: decode graphs
    replays = []
    real = graphs.run
    graphs.run = lambda batch, *a: replays.append(batch.query_lens_cpu) or real(batch, *a)
    verify = runner.verify_graphs
    assert verify is not None and verify.query_len == K + 1 and verify.feature == runner.feature
    real_verify = verify.run
    verify.run = lambda ids, ctx, *a: replays.append([K + 1] * len(ctx) + ["verify graph"]) or real_verify(ids, ctx, *a)
    prompts = [repetitive(llm, eval_text) for _ in range(3)]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(10))]
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, greedy(10))]
    assert got == want
    # one sequence alone (its prompt cached): steps of K+1 tokens, not mixed with another's prefill
    assert [o.outputs[0].token_ids for o in llm.generate(prompts[:1], greedy(10))] == want[:1]
    assert any("verify graph" in lens for lens in replays)
