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
          "linear_backend": "native", "norm_backend": "native"}
COMMON = dict(device="cuda", dtype="bfloat16", max_model_len=1024, chunked_prefill_size=40, progress=False)
# tiny-dsv4-py in bf16 is far from its fp32 self where a near-tie in the expert routing or the indexer's
# top-k flips (H200, 24 prompts: the native oracle's prompt logprobs up to 1.38 from fp32, 99th
# percentile 0.12; the fast backends' 1.52 and 0.16), so the bf16 paths are each held to the fp32
# oracle, the fast one to within a factor of the native one's error, and greedy tokens to near-ties
# of the fp32 reference's top 5 at a bound above the largest decode error seen (0.096)
BOUND = 0.25
SAME_PATH_BOUND = 0.15  # the fast backends against themselves in another batch or cache shape: two sum orders
GRAPH_BOUND = 0.05  # graph replay against eager: the same kernels at the same batch shapes (equal to the bit on
# the H200 so far); at 0.15 only 9-19% of tiny-dsv4-py's positions precede a near-tie (fp32, CPU, 6 seeds)
TOP = 5


@pytest.fixture(scope="module")
def dsv4(shared_dir):
    return str(shared_dir / "models" / "tiny-dsv4-py")


@pytest.fixture(scope="module")
def trio(dsv4):
    """The fast backends in bf16, the native oracle in bf16, and the native oracle in fp32."""
    return (LLM(dsv4, **COMMON), LLM(dsv4, **COMMON, **ORACLE),
            LLM(dsv4, **{**COMMON, "dtype": "float32"}, **ORACLE))


@pytest.fixture(scope="module")
def pair(trio):
    return trio[0], trio[1]


def _prompts(seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    stem = [rng.randrange(10, vocab) for _ in range(rng.randint(150, 300))]
    shared = [stem[:rng.randint(20, len(stem))] + [rng.randrange(10, vocab) for _ in range(rng.randint(1, 90))]
              for _ in range(4)]
    return [stem] + shared + [[rng.randrange(10, vocab) for _ in range(rng.randint(1, 400))] for _ in range(3)]


def _agree(a, b, agreement: GreedyAgreement, bound: float = SAME_PATH_BOUND, logprobs: bool = True
           ) -> GreedyAgreement:
    """Greedy tokens of ``a`` against the reference ``b`` (and their logprobs, unless told not to)."""
    for x, y in zip(a, b):
        got, want = x.outputs[0], y.outputs[0]
        agreement += compare_greedy(want.token_ids, want.logprobs, got.token_ids, got.logprobs if logprobs else None,
                                    bound=bound)
    return agreement


def _prompt_errors(a, b, want) -> tuple[torch.Tensor, torch.Tensor]:
    """|a - want| and |b - want| of the prompt logprobs of the actual next tokens, every position of
    every prompt."""
    def errors(x):
        return torch.cat([torch.tensor([next(iter(d.values())) for d in s.prompt_logprobs[1:]])
                          - torch.tensor([next(iter(d.values())) for d in w.prompt_logprobs[1:]])
                          for s, w in zip(x, want)]).abs()
    return errors(a), errors(b)


def _decode_errors(a, b, want) -> tuple[torch.Tensor, torch.Tensor]:
    """|a - want| and |b - want| of the greedy tokens' logprobs at the same positions: those before
    either sequence leaves the reference's tokens (so the two paths are measured on one sample)."""
    ea, eb = [], []
    for x, y, w in zip(a, b, want):
        x, y, w = x.outputs[0], y.outputs[0], w.outputs[0]
        for t, u, v, lx, ly, lw in zip(x.token_ids, y.token_ids, w.token_ids, x.logprobs, y.logprobs, w.logprobs):
            if not t == u == v:
                break
            ea.append(abs(lx[t] - lw[t]))
            eb.append(abs(ly[t] - lw[t]))
    return torch.tensor(ea), torch.tensor(eb)


def test_the_fast_backends_are_selected(pair):
    fast, oracle = pair
    chosen = {f: s.chosen.name for f, s in fast.engine.components.selections.items()}
    assert chosen["v4_attention"] == chosen["mhc"] == chosen["moe"] == chosen["linear"] == "triton", chosen
    assert {f: s.chosen.name for f, s in oracle.engine.components.selections.items()}["v4_attention"] == "native"


def test_greedy_and_logprobs_match_the_oracle(trio, seed):
    """The fast bf16 path is as close to the fp32 oracle as the native bf16 path is."""
    fast, native, exact = trio
    prompts = _prompts(seed, fast.engine.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, prompt_logprobs=0, logprobs=TOP)
    agreement = GreedyAgreement()
    for _ in range(2):  # the second round hits the prefix cache on all three
        want = exact.generate(prompts, params)
        got, oracle = fast.generate(prompts, params), native.generate(prompts, params)
        agreement = _agree(got, want, agreement, BOUND, logprobs=False)
        for errors in (_prompt_errors, _decode_errors):
            e_fast, e_native = errors(got, oracle, want)
            assert e_fast.mean() <= 1.5 * e_native.mean() + 2e-3, (errors.__name__, e_fast.mean(), e_native.mean())
            assert e_fast.quantile(0.99) <= 2 * e_native.quantile(0.99) + 0.02, (
                errors.__name__, e_fast.quantile(0.99), e_native.quantile(0.99))
    agreement.assert_most_sure(0.03)


def test_preemption_keeps_the_outputs(dsv4, pair, seed):
    """A cache of a few pages preempts; the outputs equal the roomy engine's."""
    fast, _ = pair
    tight = LLM(dsv4, **COMMON, num_pages=40, max_num_seqs=8)
    prompts = _prompts(seed + 1, fast.engine.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=TOP)
    agreement = _agree(tight.generate(prompts, params), fast.generate(prompts, params), GreedyAgreement())
    assert tight.engine.scheduler.stats.num_preemptions > 0
    agreement.assert_most_sure(0.03)


def test_graph_replay_equals_eager(dsv4, pair, seed):
    fast, _ = pair
    assert fast.engine.runner.graphs is not None, "DeepSeek-V4 on the fast backends should decode from graphs"
    eager = LLM(dsv4, **COMMON, enforce_eager=True)
    prompts = _prompts(seed + 2, fast.engine.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=TOP)
    agreement = _agree(fast.generate(prompts, params), eager.generate(prompts, params), GreedyAgreement(), GRAPH_BOUND)
    agreement.assert_most_sure(0.1)
