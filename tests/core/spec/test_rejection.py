"""Speculative rejection sampling gives the target's distribution: chains of two drafts (one-hot,
as n-gram's, and drawn from a draft distribution) verified over many seeded draws on a small
vocabulary, every token given tested against the target's by chi-square; a sampler whose
acceptance is biased fails the same test. Greedy rows keep drafts equal to their argmax."""

from __future__ import annotations

import random

import pytest
import torch

from engine.core.native.sampling import filter_logits
from engine.core.spec import rejection

VOCAB, DRAFTS, CHAINS = 6, 2, 20000


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """The p-value of ``counts`` drawn from ``probs``; a token of probability 0 drawn fails outright.
    The least expected tokens are pooled until the pool is expected 5 times or more, as the test's
    approximation asks (a pool expected less makes rare tokens look far rarer than they are)."""
    if counts[probs == 0].any():
        return 0.0
    expected, observed = (probs * counts.sum())[probs > 0], counts[probs > 0]
    order = expected.argsort()
    expected, observed = expected[order], observed[order]
    cut = int((expected.cumsum(0) < 5).sum()) + 1  # the smallest tokens that together reach 5
    observed = torch.cat([observed[:cut].sum()[None], observed[cut:]])
    expected = torch.cat([expected[:cut].sum()[None], expected[cut:]])
    df = len(expected) - 1
    if df == 0:  # one token takes it all: nothing to test beyond the support
        return 1.0
    stat = ((observed - expected) ** 2 / expected).sum()
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat.double() / 2))


def setting(rng: random.Random, filtered: bool = True):
    """Target logits of each position of a chain (fixed: position j's target does not depend on the
    tokens before it), per-position sampling settings, and the target distributions they make."""
    logits = torch.randn(DRAFTS + 1, VOCAB)
    temperature = [rng.uniform(0.7, 1.3) if filtered else 1.0 for _ in range(DRAFTS + 1)]
    top_k = [rng.choice([0, 5]) if filtered else 0 for _ in range(DRAFTS + 1)]
    top_p = [rng.choice([1.0, 0.95]) if filtered else 1.0 for _ in range(DRAFTS + 1)]
    min_p = [rng.choice([0.0, 0.02]) if filtered else 0.0 for _ in range(DRAFTS + 1)]
    target = filter_logits(logits / torch.tensor(temperature)[:, None], top_k, top_p, min_p).softmax(dim=-1)
    return logits, temperature, top_k, top_p, min_p, target


def run_chains(logits, temperature, top_k, top_p, min_p, target, draft_probs, generator) -> list[list[int]]:
    """``CHAINS`` chains verified at once: the tokens each gives (kept drafts, then the target's)."""
    if draft_probs is None:  # one-hot: half the chains draft any token, half a token the target may well give
        likely = torch.where(target[:DRAFTS] <= 0.5, target[:DRAFTS], -1.0).argmax(dim=-1)
        drafts = torch.where(torch.rand(CHAINS, 1, generator=generator) < 0.5, likely,
                             torch.randint(VOCAB, (CHAINS, DRAFTS), generator=generator))
        q = None
    else:
        drafts = torch.stack([torch.multinomial(draft_probs[j], CHAINS, replacement=True, generator=generator)
                              for j in range(DRAFTS)], dim=1)
        q = torch.cat([draft_probs, torch.zeros(1, VOCAB)]).repeat(CHAINS, 1)
    rows = CHAINS * (DRAFTS + 1)
    draft = torch.cat([drafts, torch.full((CHAINS, 1), -1)], dim=1).reshape(-1)
    uniform = 1 - torch.rand(rows, generator=generator)  # U(0, 1]
    noise = torch.empty(rows, VOCAB).exponential_(generator=generator)
    kept, given = rejection.verify(logits.repeat(CHAINS, 1), draft, list(range(rows)), temperature * CHAINS,
                                   top_k * CHAINS, top_p * CHAINS, min_p * CHAINS, uniform, noise, q)
    kept, given, draft = (t.reshape(CHAINS, DRAFTS + 1).tolist() for t in (kept, given, draft))
    chains = []
    for k, g, d in zip(kept, given, draft):
        a = 0
        while a < DRAFTS and k[a]:
            a += 1
        chains.append(d[:a] + [g[a]])
    return chains


def position_p_values(chains: list[list[int]], target: torch.Tensor) -> list[float]:
    """Per position, the chi-square p-value of the tokens chains give there against the target's."""
    out = []
    for j in range(DRAFTS + 1):
        tokens = torch.tensor([c[j] for c in chains if len(c) > j])
        assert len(tokens) > 100, f"too few chains reach position {j}"
        out.append(chi_square_p(torch.bincount(tokens, minlength=VOCAB).double(), target[j].double()))
    return out


def draft_distribution(logits: torch.Tensor, draft_kind: str) -> torch.Tensor | None:
    """None for one-hot drafts; else a drafter near the target, as a useful one is."""
    return None if draft_kind == "one-hot" else (logits[:DRAFTS] + torch.randn(DRAFTS, VOCAB)).softmax(dim=-1)


@pytest.mark.parametrize("draft_kind", ["one-hot", "distribution"])
def test_every_token_given_is_distributed_as_the_targets(seed, draft_kind):
    logits, temperature, top_k, top_p, min_p, target = setting(random.Random(seed))
    chains = run_chains(logits, temperature, top_k, top_p, min_p, target, draft_distribution(logits, draft_kind),
                        torch.Generator().manual_seed(seed))
    p_values = position_p_values(chains, target)
    assert min(p_values) > 1e-5, p_values


@pytest.mark.parametrize("draft_kind", ["one-hot", "distribution"])
def test_the_same_test_fails_a_sampler_that_keeps_drafts_a_little_too_often(seed, draft_kind, monkeypatch):
    logits, temperature, top_k, top_p, min_p, target = setting(random.Random(seed), filtered=False)
    monkeypatch.setattr(rejection, "accepts", lambda p, q, u: u * q < 2.0 * p)
    chains = run_chains(logits, temperature, top_k, top_p, min_p, target, draft_distribution(logits, draft_kind),
                        torch.Generator().manual_seed(seed))
    assert min(position_p_values(chains, target)) < 1e-6


def test_seeded_draws_repeat_and_a_draft_the_target_cannot_give_is_never_kept(seed):
    rng = random.Random(seed)
    logits, temperature, top_k, top_p, min_p, target = setting(rng)
    args = (logits, temperature, top_k, top_p, min_p, target, None)
    assert run_chains(*args, torch.Generator().manual_seed(seed)) == run_chains(*args, torch.Generator().manual_seed(seed))
    impossible = (target[0] == 0).nonzero().flatten().tolist()
    if impossible:
        draft = torch.tensor([impossible[0], -1])
        kept, given = rejection.verify(logits[:2], draft, [0, 1], temperature[:2], top_k[:2], top_p[:2], min_p[:2],
                                       torch.zeros(2), torch.ones(2, VOCAB))
        assert not kept[0] and target[0, given[0]] > 0


def test_greedy_rows_keep_drafts_equal_to_their_argmax_beside_sampled_rows(seed):
    x = torch.randn(7, 11)
    best = x.argmax(dim=-1)
    draft = torch.tensor([best[0], best[1], (best[2] + 1) % 11, -1, best[4], best[5], -1])
    sampled = [4, 5, 6]  # a sampled chain at near-zero temperature follows the argmax too
    kept, given = rejection.verify(x, draft, sampled, [1e-3] * 3, [0] * 3, [1.0] * 3, [0.0] * 3,
                                   torch.rand(3), torch.empty(3, 11).exponential_())
    assert kept.tolist() == [True, True, False, False, True, True, False]
    assert [given[i] for i in (2, 3, 6)] == [best[i] for i in (2, 3, 6)]  # where a row gives its own token
