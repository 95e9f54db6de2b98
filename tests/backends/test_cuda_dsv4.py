"""DeepSeek-V4 (tiny-dsv4-py) on a GPU with its fast backends against the native oracles on the same GPU.

The prompts share prefixes (so later ones hit the prefix cache, inside compression windows too:
chunks of 40 tokens do not align with CSA's rate 4 windows' pages or HCA's rate 16), chunked
prefill cuts them, and a small KV cache makes the scheduler preempt and recompute.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from greedy_agreement import GreedyAgreement, compare_greedy

pytestmark = pytest.mark.gpu

ORACLE = {"v4_attention_backend": "native", "mhc_backend": "native", "moe_backend": "native",
          "linear_backend": "native"}
COMMON = dict(device="cuda", dtype="bfloat16", max_model_len=1024, chunked_prefill_size=40, progress=False)
BOUND = 0.15  # bf16 logprobs of two summation orders (the Qwen3 engine test's bound)


@pytest.fixture(scope="module")
def dsv4(shared_dir):
    return str(shared_dir / "models" / "tiny-dsv4-py")


@pytest.fixture(scope="module")
def pair(dsv4):
    return LLM(dsv4, **COMMON), LLM(dsv4, **COMMON, **ORACLE)


def _prompts(seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    stem = [rng.randrange(10, vocab) for _ in range(rng.randint(150, 300))]
    shared = [stem[:rng.randint(20, len(stem))] + [rng.randrange(10, vocab) for _ in range(rng.randint(1, 90))]
              for _ in range(4)]
    return [stem] + shared + [[rng.randrange(10, vocab) for _ in range(rng.randint(1, 400))] for _ in range(3)]


def _agree(a, b, agreement: GreedyAgreement) -> float:
    worst = 0.0
    for x, y in zip(a, b):
        if x.prompt_logprobs is not None:
            lx = torch.tensor([next(iter(d.values())) for d in x.prompt_logprobs[1:]])
            ly = torch.tensor([next(iter(d.values())) for d in y.prompt_logprobs[1:]])
            worst = max(worst, (lx - ly).abs().max().item() if len(lx) else 0.0)
        got, want = x.outputs[0], y.outputs[0]
        agreement += compare_greedy(want.token_ids, want.logprobs, got.token_ids, got.logprobs, bound=BOUND)
    return worst


def test_the_fast_backends_are_selected(pair):
    fast, oracle = pair
    chosen = {f: s.chosen.name for f, s in fast.engine.components.selections.items()}
    assert chosen["v4_attention"] == chosen["mhc"] == chosen["moe"] == chosen["linear"] == "triton", chosen
    assert {f: s.chosen.name for f, s in oracle.engine.components.selections.items()}["v4_attention"] == "native"


def test_greedy_and_logprobs_match_the_oracle(pair, seed):
    fast, oracle = pair
    prompts = _prompts(seed, fast.engine.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, prompt_logprobs=0, logprobs=2)
    agreement = GreedyAgreement()
    for _ in range(2):  # the second round hits the prefix cache on both sides
        worst = _agree(fast.generate(prompts, params), oracle.generate(prompts, params), agreement)
        assert worst < BOUND, worst
    agreement.assert_most_sure(0.03)


def test_preemption_keeps_the_outputs(dsv4, pair, seed):
    """A cache of a few pages preempts; the outputs equal the roomy engine's."""
    fast, _ = pair
    tight = LLM(dsv4, **COMMON, num_pages=40, max_num_seqs=8)
    prompts = _prompts(seed + 1, fast.engine.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=2)
    agreement = GreedyAgreement()
    _agree(tight.generate(prompts, params), fast.generate(prompts, params), agreement)
    assert tight.engine.scheduler.stats.num_preemptions > 0
    agreement.assert_most_sure(0.03)


def test_graph_replay_equals_eager(dsv4, pair, seed):
    fast, _ = pair
    assert fast.engine.runner.graphs is not None, "DeepSeek-V4 on the fast backends should decode from graphs"
    eager = LLM(dsv4, **COMMON, enforce_eager=True)
    prompts = _prompts(seed + 2, fast.engine.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=2)
    agreement = GreedyAgreement()
    _agree(fast.generate(prompts, params), eager.generate(prompts, params), agreement)
    agreement.assert_most_sure(0.1)
