"""Greedy tokens of two floating-point paths, compared as far as the numbers decide them.

Two paths that compute the same logits to within ``bound`` (other kernels, another sum order, TF32,
a graph's padded batch, HF's reference) must pick the same greedy token wherever the reference's
top-2 margin exceeds ``2 * bound``: each of the two logits may move by ``bound``. Below that the
pick is a near-tie either path may break its own way, and once they part, what follows are two
different continuations that cannot be compared. So a comparison walks each sequence while the
prefixes are equal; a different token is a failure unless it is a near-tie of the reference's top
token, and it ends the walk. Where the tokens agree, their logprobs must agree within ``bound``.

How much is checked depends on the reference alone: ``sure`` counts the positions up to and
including the reference's first near-tie, compared whatever the other path does. A test asserts
that they are most of the positions, or the bound is too loose for what it claims.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Scores = dict[int, float]  # token id -> logprob or logit (margins are the same): the top 2 at least


@dataclass(frozen=True)
class GreedyAgreement:
    positions: int = 0  # reference tokens in all
    compared: int = 0  # positions compared on equal prefixes (through the first divergence)
    sure: int = 0  # positions through the reference's first near-tie: compared whatever the other does

    def __add__(self, other: GreedyAgreement) -> GreedyAgreement:
        return GreedyAgreement(self.positions + other.positions, self.compared + other.compared,
                               self.sure + other.sure)

    def assert_most_sure(self, fraction: float = 0.5) -> None:
        assert self.sure >= fraction * self.positions, (
            f"only {self.sure} of {self.positions} positions precede a near-tie of the reference: "
            f"the bound is too loose for a {fraction:.0%} check")


def margin(scores: Scores) -> float:
    """The top-2 margin of one position's scores."""
    assert len(scores) >= 2, f"the reference needs its top-2 scores at every position, got {scores}"
    first, second = sorted(scores.values(), reverse=True)[:2]
    return first - second


def top2(logits: torch.Tensor) -> Scores:
    """A reference's scores at one position from its logits row (HF's, for one)."""
    values, ids = logits.float().topk(2)
    return dict(zip(ids.tolist(), values.tolist()))


def compare_greedy(ref_tokens: list[int], ref_scores: list[Scores], tokens: list[int],
                   logprobs: list[Scores] | None = None, *, bound: float) -> GreedyAgreement:
    """Compare one sequence's greedy ``tokens`` against the reference's, and their ``logprobs`` where
    given (the reference's scores are then logprobs too); raise AssertionError naming the position."""
    assert len(ref_scores) == len(ref_tokens), (len(ref_scores), len(ref_tokens))
    near = 2 * bound
    sure = next((i + 1 for i, s in enumerate(ref_scores) if margin(s) <= near), len(ref_tokens))
    for i, (want, scores) in enumerate(zip(ref_tokens, ref_scores)):
        assert scores.get(want) == max(scores.values()), f"position {i}: reference token {want} is not its argmax"
        assert i < len(tokens), f"position {i}: the sequence ends after {len(tokens)} tokens, the reference goes on"
        got = tokens[i]
        if got != want:
            assert margin(scores) <= near, (
                f"position {i}: token {got}, reference {want} with top-2 margin {margin(scores):.3g} "
                f"> 2 * bound {near:.3g}")
            assert scores[want] - scores.get(got, float("-inf")) <= near, (
                f"position {i}: token {got} is not a near-tie of the reference's {want}: {scores}")
            return GreedyAgreement(len(ref_tokens), i + 1, sure)
        if logprobs is not None:
            diff = abs(logprobs[i][got] - scores[want])
            assert diff <= bound, f"position {i}: logprob of {got} {diff:.3g} from the reference's (bound {bound:.3g})"
    assert len(tokens) == len(ref_tokens), f"{len(tokens)} tokens, the reference has {len(ref_tokens)}"
    return GreedyAgreement(len(ref_tokens), len(ref_tokens), sure)


def compare_requests(got, want, *, bound: float) -> tuple[GreedyAgreement, float]:
    """``compare_greedy`` over the outputs of one batch of prompts on two paths (``want`` the reference,
    both asked for logprobs and ``prompt_logprobs=0``), and the largest gap of their prompt logprobs."""
    agreement, worst = GreedyAgreement(), 0.0
    for x, y in zip(got, want, strict=True):
        lx = torch.tensor([next(iter(d.values())) for d in x.prompt_logprobs[1:]])
        ly = torch.tensor([next(iter(d.values())) for d in y.prompt_logprobs[1:]])
        worst = max(worst, (lx - ly).abs().max().item() if len(lx) else 0.0)
        g, w = x.outputs[0], y.outputs[0]
        agreement += compare_greedy(w.token_ids, w.logprobs, g.token_ids, g.logprobs, bound=bound)
    return agreement, worst
