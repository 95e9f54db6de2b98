"""The interfaces of the speculative-decoding and cache-tier families, through the smallest
implementations that exercise them (the real ones come with their features; the KV transport's
real one is tested in tests/core/disagg)."""

from __future__ import annotations

import random

import pytest
import torch

from engine.core.families.cache_tier import CacheTier, TierPage
from engine.core.families.spec import DraftRequest, Drafts, SpecProposer


class RepeatLast(SpecProposer):
    """Drafts the last token k times: deterministic, so no draft distribution."""

    name = "repeat-last"

    def propose(self, requests, features=None):
        return Drafts([[r.token_ids[-1]] * r.k for r in requests])


def test_a_proposer_answers_every_sequence_within_its_k(seed):
    requests = [DraftRequest(i, [random.randrange(100) for _ in range(random.randint(1, 9))], random.randint(0, 5))
                for i in range(4)]
    drafts = RepeatLast(None).propose(requests)
    drafts.check(requests)
    assert [len(d) for d in drafts.token_ids] == [r.k for r in requests]
    with pytest.raises(TypeError):
        SpecProposer(None)  # propose is abstract


@pytest.mark.parametrize("bad, field", [
    (Drafts([[1, 2, 3]]), r"token_ids: 3 drafts for sequence 0, at most k=2"),
    (Drafts([[1], [2]]), r"token_ids: 2 draft lists for 1 sequences"),
    (Drafts([[1, 2]], torch.rand(3, 8)), r"probs: shape \[3, 8\], want \[2, vocab\]"),
])
def test_drafts_that_do_not_answer_the_requests_are_refused(bad, field):
    with pytest.raises(ValueError, match=field):
        bad.check([DraftRequest(0, [5], 2)])


class DictTier(CacheTier):
    name = "dict"

    def __init__(self, ctx):
        super().__init__(ctx)
        self.pages: dict[str, TierPage] = {}

    def put(self, pages):
        self.pages.update((p.key, p) for p in pages)
        return [True] * len(pages)

    def get(self, keys):
        return [self.pages.get(k) for k in keys]

    def contains(self, keys):
        return next((i for i, k in enumerate(keys) if k not in self.pages), len(keys))


def test_a_cache_tier_returns_pages_by_key_and_a_corrupt_one_fails_its_checksum(seed):
    tier = DictTier(None)
    pages = [TierPage.of(f"prefix-{i}", torch.randn(2, 4, 8)) for i in range(3)]
    assert tier.put(pages[:2]) == [True, True]
    assert tier.contains([p.key for p in pages]) == 2 and tier.contains(["other"]) == 0
    got = tier.get([p.key for p in pages])
    assert got[2] is None and all(g.intact() and torch.equal(g.data, p.data) for g, p in zip(got[:2], pages))
    got[0].data.view(-1)[random.randrange(64)] += 1.0  # a flipped value in storage
    assert not tier.get([pages[0].key])[0].intact()

