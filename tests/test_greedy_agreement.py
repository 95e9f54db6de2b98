"""The margin-aware greedy comparison of tests/greedy_agreement.py, on constructed logits."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from greedy_agreement import GreedyAgreement, compare_greedy, compare_requests, margin

BOUND = 1e-3
V = 50


def _scores(logits: torch.Tensor) -> list[dict[int, float]]:
    """Per position the top-2 logprobs, as the engine reports them for ``logprobs=2``."""
    lp = logits.log_softmax(-1)
    top = lp.topk(2, dim=-1)
    return [dict(zip(i.tolist(), v.tolist())) for i, v in zip(top.indices, top.values)]


def _reference(n: int, ties: list[int]) -> torch.Tensor:
    """Random logits with a clear top token everywhere but at ``ties``, where the runner-up is within the bound."""
    logits = torch.randn(n, V)
    top = logits.argmax(-1)
    logits[torch.arange(n), top] += 1.0  # margins of at least 1 elsewhere
    for i in ties:
        second = (logits[i].argsort(descending=True))[1]
        logits[i, second] = logits[i, top[i]] - random.uniform(0, BOUND)
    return logits


def _greedy(logits: torch.Tensor) -> list[int]:
    return logits.argmax(-1).tolist()


def test_a_perturbation_within_the_bound_passes_and_may_part_only_at_a_near_tie(seed):
    total = GreedyAgreement()
    for _ in range(20):
        n = random.randint(8, 40)
        ties = random.sample(range(n), random.randint(0, 3))
        ref = _reference(n, ties)
        other = ref + torch.empty_like(ref).uniform_(-BOUND / 2, BOUND / 2)  # logprobs move by <= bound
        tokens = _greedy(other)
        parted = next((i for i in range(n) if tokens[i] != _greedy(ref)[i]), None)
        if parted is not None:  # what follows a divergence is another continuation: garbage here
            tokens[parted + 1:] = [random.randrange(V) for _ in tokens[parted + 1:]]
        got = compare_greedy(_greedy(ref), _scores(ref), tokens, _scores(other), bound=BOUND)
        assert parted is None or parted in ties
        assert got.compared == (n if parted is None else parted + 1)
        assert got.sure == (min(ties) + 1 if ties else n) and got.compared >= got.sure
        total += got
    assert total.positions > 0 and total.compared >= total.sure


def test_a_different_token_where_the_margin_is_clear_fails(seed):
    ref = _reference(12, ties=[])
    tokens = _greedy(ref)
    i = random.randrange(12)
    tokens[i] = (tokens[i] + 1) % V
    with pytest.raises(AssertionError, match=f"position {i}: .* top-2 margin"):
        compare_greedy(_greedy(ref), _scores(ref), tokens, bound=BOUND)


def test_a_different_token_at_a_near_tie_must_be_the_runner_up(seed):
    ref = _reference(12, ties=[5])
    runner_up = sorted(_scores(ref)[5], key=_scores(ref)[5].get)[0]
    tokens = _greedy(ref)
    tokens[5] = runner_up
    assert compare_greedy(_greedy(ref), _scores(ref), tokens, bound=BOUND).compared == 6
    tokens[5] = next(t for t in range(V) if t not in _scores(ref)[5])
    with pytest.raises(AssertionError, match="position 5: .* not a near-tie"):
        compare_greedy(_greedy(ref), _scores(ref), tokens, bound=BOUND)


def test_logprobs_where_the_tokens_agree_must_be_within_the_bound(seed):
    ref = _reference(10, ties=[])
    other = ref.clone()
    i = random.randrange(10)
    other[i] += torch.nn.functional.one_hot(ref[i].argmax(), V) * 10 * BOUND  # the top logit alone moves
    with pytest.raises(AssertionError, match=f"position {i}: logprob"):
        compare_greedy(_greedy(ref), _scores(ref), _greedy(other), _scores(other), bound=BOUND)
    compare_greedy(_greedy(ref), _scores(ref), _greedy(other), bound=BOUND)  # tokens alone agree


def test_a_short_sequence_and_a_reference_without_top_2_fail(seed):
    ref = _reference(10, ties=[])
    with pytest.raises(AssertionError, match="ends after 9 tokens"):
        compare_greedy(_greedy(ref), _scores(ref), _greedy(ref)[:9], bound=BOUND)
    with pytest.raises(AssertionError, match="top-2"):
        compare_greedy(_greedy(ref), [{t: 0.0} for t in _greedy(ref)], _greedy(ref), bound=BOUND)


def test_most_positions_must_precede_the_first_near_tie(seed):
    early = GreedyAgreement(positions=10, compared=10, sure=2)
    with pytest.raises(AssertionError, match="only 2 of 10"):
        early.assert_most_sure()
    (early + GreedyAgreement(positions=10, compared=10, sure=10)).assert_most_sure()
    assert margin({1: -0.5, 2: -0.75, 3: -3.0}) == pytest.approx(0.25)


def _request(prompt_logprobs: list[float], logits: torch.Tensor) -> SimpleNamespace:
    """A request's output as the engine gives it: prompt logprobs (none for the first token) and one completion."""
    completion = SimpleNamespace(token_ids=_greedy(logits), logprobs=_scores(logits))
    return SimpleNamespace(prompt_logprobs=[None] + [{7: v} for v in prompt_logprobs], outputs=[completion])


def test_requests_compare_their_completions_and_report_the_widest_prompt_gap(seed):
    refs = [_reference(8, ties=[]) for _ in range(3)]
    prompt = [[random.uniform(-5, 0) for _ in range(random.randint(0, 6))] for _ in refs]
    moved = [p[:] for p in prompt]
    gap = random.uniform(0, 1)
    k = next(k for k, p in enumerate(prompt) if p) if any(prompt) else None
    if k is not None:
        moved[k][-1] += gap
    agreement, worst = compare_requests([_request(m, r) for m, r in zip(moved, refs)],
                                        [_request(p, r) for p, r in zip(prompt, refs)], bound=BOUND)
    assert agreement == GreedyAgreement(24, 24, 24)
    assert worst == pytest.approx(gap if k is not None else 0.0, abs=1e-5)  # the logprobs meet in fp32
    other = refs[1].clone()
    other[3] += torch.nn.functional.one_hot(refs[1][3].argmin(), V) * 10  # another token wins by far
    with pytest.raises(AssertionError, match="position 3"):
        compare_requests([_request(p, r) for p, r in zip(prompt, [refs[0], other, refs[2]])],
                         [_request(p, r) for p, r in zip(prompt, refs)], bound=BOUND)
