"""Grammar masks: unpacked bit for bit, applied to the constrained rows only, and every draw of a
constrained row (greedy, sampled, with penalties and bias) among the tokens its grammar allows."""

from __future__ import annotations

import random

import pytest
import torch

from engine.core.sampler import Sampler
from engine.core.sampling_params import SamplingParams
from engine.core.sequence import Sequence
from engine.core.structured.bitmask import mask_logits, unpack
from engine.core.token_table import TokenTable


class SetMatcher:
    """A matcher that allows a fixed set of tokens (xgrammar's bitmask layout)."""

    def __init__(self, allowed: set[int]) -> None:
        self.allowed = allowed

    def fill_next_token_bitmask(self, mask: torch.Tensor, row: int) -> None:
        words = [0] * mask.shape[1]
        for t in self.allowed:
            words[t // 32] |= 1 << (t % 32)
        mask[row] = torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)


def test_unpack_reads_every_bit(seed):
    V = random.randint(33, 300)
    words = torch.randint(-2**31, 2**31, (5, -(-V // 32)), dtype=torch.int64).to(torch.int32)
    got = unpack(words, V)
    for r in range(5):
        for t in range(V):
            assert bool(got[r, t]) == bool((int(words[r, t // 32]) >> (t % 32)) & 1)


def test_mask_touches_only_the_constrained_rows(seed):
    V, B = 200, 7
    logits = torch.randn(B, V)
    rows = sorted(random.sample(range(B), 3))
    allowed = [set(random.sample(range(V), random.randint(1, 20))) for _ in rows]
    out = mask_logits(logits, rows, [SetMatcher(a) for a in allowed])
    for i in range(B):
        if i not in rows:
            assert torch.equal(out[i], logits[i])
    for i, a in zip(rows, allowed):
        keep = torch.zeros(V, dtype=torch.bool)
        keep[list(a)] = True
        assert torch.equal(out[i][keep], logits[i][keep])
        assert bool((out[i][~keep] == float("-inf")).all())


@pytest.mark.parametrize("opts", [dict(temperature=0), dict(temperature=1.0), dict(temperature=0.7, top_k=5),
                                  dict(temperature=1.0, top_p=0.5, logprobs=2),
                                  dict(temperature=0, repetition_penalty=1.3, logit_bias={7: 50.0})])
def test_draws_of_constrained_rows_are_allowed_and_the_others_unchanged(seed, opts):
    V, B = 150, 9
    logits = torch.randn(B, V) * 3
    rows, matchers = [], {}
    for i in range(B):
        gen = torch.Generator().manual_seed(seed + i)
        rows.append(Sequence(i, f"r{i}", 0, [random.randrange(V) for _ in range(4)], SamplingParams(seed=1, **opts),
                             gen, [random.randrange(V) for _ in range(2)]))
    for i in random.sample(range(B), 4):
        matchers[i] = SetMatcher(set(random.sample(range(V), random.randint(1, 6))))
        rows[i].grammar = matchers[i]
    free = [Sequence(i, f"r{i}", 0, r.prompt_token_ids, r.params, torch.Generator().manual_seed(seed + i),
                     list(r.output_token_ids)) for i, r in enumerate(rows)]
    out = Sampler(V, {1}, TokenTable(4, "cpu"), seed=seed)(logits, rows)
    ref = Sampler(V, {1}, TokenTable(4, "cpu"), seed=seed)(logits, free)
    for i in range(B):
        if i in matchers:
            assert out.token_ids[i] in matchers[i].allowed
        else:  # seeded rows draw from their own generators: the grammar of others changes nothing
            assert out.token_ids[i] == ref.token_ids[i]
    assert out.constrained and not ref.constrained
