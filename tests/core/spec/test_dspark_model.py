"""The DSpark drafter as a module, on a tiny random shape: the block's outputs see the target's
features only before each anchor (and its own block), the Markov head makes each draft follow the
one before, the confidence lies in [0, 1]."""

from __future__ import annotations

import pytest
import torch

from engine.core.spec.dspark.model import DSparkDrafter, DSparkShape

V, D, F = 32, 16, 24


@pytest.fixture
def drafter(seed):
    shape = DSparkShape(vocab_size=V, hidden_size=D, feature_size=F, target_layer_ids=(0, 2), block_size=4,
                        num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8, intermediate_size=32, markov_rank=8,
                        mask_token_id=V - 1)
    embed, head = torch.nn.Embedding(V, D), torch.nn.Linear(D, V, bias=False)
    return DSparkDrafter(shape, embed, head).eval()


def blocks(drafter, features, anchor):
    """One sequence's block at ``anchor`` over all of its context rows before it."""
    n = features.shape[0]
    ctx = drafter.context_kv(features[None], torch.arange(n)[None])
    valid = (torch.arange(n) < anchor)[None]
    return drafter.block(torch.tensor([3]), torch.tensor([anchor]), ctx, valid)


@torch.no_grad()
def test_the_block_reads_the_target_features_before_its_anchor_only(drafter):
    n, anchor = 12, 7
    features = torch.randn(n, F)
    out = blocks(drafter, features, anchor)
    assert out.shape == (1, 4, D)
    later = features.clone()
    later[anchor:] = torch.randn(n - anchor, F)  # the anchor's own and after
    torch.testing.assert_close(blocks(drafter, later, anchor), out)
    earlier = features.clone()
    earlier[anchor - 1] += 1.0
    assert not torch.allclose(blocks(drafter, earlier, anchor), out)


@torch.no_grad()
def test_a_batch_of_blocks_is_each_block_alone(drafter):
    feats = [torch.randn(n, F) for n in (5, 9)]
    alone = [blocks(drafter, f, len(f)) for f in feats]
    c = max(len(f) for f in feats)
    padded = torch.stack([torch.cat([f, torch.zeros(c - len(f), F)]) for f in feats])
    ctx = drafter.context_kv(padded, torch.arange(c).expand(2, c))
    valid = torch.stack([torch.arange(c) < len(f) for f in feats])
    both = drafter.block(torch.tensor([3, 3]), torch.tensor([len(f) for f in feats]), ctx, valid)
    torch.testing.assert_close(both, torch.cat(alone))


@torch.no_grad()
def test_each_draft_follows_the_one_before_through_the_markov_head(drafter):
    # W1[x] one-hot-like and W2 mapping it to x + 1: the bias pushes each draft to its predecessor + 1
    r = drafter.shape.markov_rank
    drafter.markov_w1.weight.zero_()
    drafter.markov_w2.weight.zero_()
    for x in range(r):
        drafter.markov_w1.weight[x, x] = 1.0
        drafter.markov_w2.weight[x + 1, x] = 100.0
    hidden = torch.randn(1, 4, D).expand(2, 4, D)  # one block's outputs, two anchors
    tokens, conf = drafter.draft(hidden, torch.tensor([0, 2]), 4)
    assert tokens.tolist() == [[1, 2, 3, 4], [3, 4, 5, 6]]
    assert conf.shape == (2, 4)


@torch.no_grad()
def test_confidence_lies_in_0_1_and_reads_the_draft_before(drafter):
    torch.nn.init.normal_(drafter.confidence.weight, std=10.0)
    hidden = torch.randn(64, 4, D)
    prev = torch.randint(0, V, (64,))
    c = torch.sigmoid(drafter.confidence_logit(hidden[:, 0], prev))
    assert ((c >= 0) & (c <= 1)).all() and c.min() < 0.1 and c.max() > 0.9
    other = torch.sigmoid(drafter.confidence_logit(hidden[:, 0], (prev + 1) % V))
    assert not torch.allclose(c, other)
    _, conf = drafter.draft(hidden, prev, 3)
    assert ((conf >= 0) & (conf <= 1)).all()


def test_the_shape_round_trips_through_json():
    s = DSparkShape(vocab_size=V, hidden_size=D, feature_size=F, target_layer_ids=(1, 3))
    assert DSparkShape.from_json(s.to_json()) == s
