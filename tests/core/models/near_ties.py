"""The near ties the engine's indexer top-k meets: where two computations of the same logits may
rank a pick either way, so a test comparing them may draw its inputs again."""

from __future__ import annotations

import contextlib

import torch

from engine.core.native import indexer

NEAR_TIE = 1e-5  # relative gap of the k-th and (k+1)-th indexer scores that fp32 rounding order can flip


@contextlib.contextmanager
def indexer_near_ties():
    """The near ties the engine's indexer top-k meets inside the block: exact ties follow the stable
    rule on both sides, but scores a rounding apart may rank either way in differently ordered sums
    (HF's, or another chunking's). The candidate filter's block top-k counts too."""
    orig, ties = indexer.stable_topk, []

    def recording(scores: torch.Tensor, k: int) -> torch.Tensor:
        if scores.shape[-1] > k:
            v = scores.sort(dim=-1, descending=True).values
            a, b = v[..., k - 1], v[..., k]
            close = torch.isfinite(b) & (a != b) & ((a - b) < NEAR_TIE * a.abs())
            ties.extend(((a - b) / a.abs())[close].tolist())
        return orig(scores, k)

    indexer.stable_topk = recording
    try:
        yield ties
    finally:
        indexer.stable_topk = orig
