"""The interfaces of the speculative-decoding, KV-transport and cache-tier families, through the
smallest implementations that exercise them (the real ones come with their features)."""

from __future__ import annotations

import random

import pytest
import torch

from engine.core.families.cache_tier import CacheTier, TierPage
from engine.core.families.kv_transport import KVPeer, KVTransport, TransferHandle, TransferStatus
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


class Done(TransferHandle):
    def __init__(self, status, error=None):
        self._status, self._error = status, error

    def status(self):
        return self._status

    @property
    def error(self):
        return self._error


class Loopback(KVTransport):
    """Two ends in one process: pages are rows of each end's tensor, rooms a dict."""

    name = "loopback"
    rooms: dict[int, list[TierPage]] = {}

    def __init__(self, ctx, kv):
        super().__init__(ctx)
        self.kv = kv

    def send(self, peer, page_ids, dst_page_ids):
        self.rooms[peer.room] = [TierPage.of(str(d), self.kv[s].clone()) for s, d in zip(page_ids, dst_page_ids)]
        return Done(TransferStatus.DONE)

    def receive(self, peer, page_ids):
        pages = self.rooms.pop(peer.room, None)
        if pages is None:
            return Done(TransferStatus.PENDING)
        if [p.key for p in pages] != [str(i) for i in page_ids] or not all(p.intact() for p in pages):
            return Done(TransferStatus.FAILED, "a page failed its checksum")
        for i, p in zip(page_ids, pages):
            self.kv[i] = p.data
        return Done(TransferStatus.DONE)


def test_a_transport_moves_pages_by_id_list_and_a_corrupt_payload_fails(seed):
    prefill, decode = Loopback(None, torch.randn(8, 4)), Loopback(None, torch.zeros(8, 4))
    peer = KVPeer("127.0.0.1", 0, room=7)
    assert decode.receive(peer, [5, 6]).status() is TransferStatus.PENDING
    assert prefill.send(peer, [1, 3], [5, 6]).status() is TransferStatus.DONE
    assert decode.receive(peer, [5, 6]).status() is TransferStatus.DONE
    assert torch.equal(decode.kv[[5, 6]], prefill.kv[[1, 3]])
    prefill.send(peer, [2], [4])
    Loopback.rooms[7][0].data.add_(1.0)
    handle = decode.receive(peer, [4])
    assert handle.status() is TransferStatus.FAILED and "checksum" in handle.error
    assert not decode.kv[4].any()
