"""Which drafts the target keeps, row by row, and the token each row gives where its draft is
rejected (or where it has none: the bonus token after the last draft).

Greedy rows keep a draft equal to their argmax and give the argmax. Sampled rows use speculative
rejection sampling: a draft ``d`` drafted with probability ``q(d)`` is kept with probability
``min(1, p(d) / q(d))``, ``p`` the target's distribution after temperature, top-k, top-p and
min-p; a rejected row gives a token of the normalised ``max(0, p - q)``, a row without a draft a
token of ``p``. So every token given is distributed as the target's (Leviathan et al., 2023). A
deterministic proposer (n-gram) has ``q`` one-hot on its draft: kept with probability ``p(d)``,
else a token of ``p`` without ``d``. Draws are ``argmax(weights / noise)`` with Exp(1) noise, as
the sampler's (core/sampler.py), so unnormalised weights draw the same.
"""

from __future__ import annotations

import torch

from ..native.sampling import filter_logits
from ..to_device import to_device


def accepts(p: torch.Tensor, q: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Keep a draft with probability min(1, p / q): ``uniform`` is U(0, 1]. Never one the target
    cannot give (p = 0), and always one it must (p = q = 1, where a strict bound would miss u = 1)."""
    return (uniform * q <= p) & (p > 0)


def rejection_sample(x: torch.Tensor, draft: torch.Tensor, has_draft: torch.Tensor, temperature: list[float],
                     top_k: list[int], top_p: list[float], min_p: list[float], uniform: torch.Tensor,
                     noise: torch.Tensor, q: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of fp32 logits ``x`` [R, V]: whether it keeps ``draft`` (where ``has_draft``), and the
    token it gives otherwise. ``uniform`` [R] is U(0, 1], ``noise`` [R, V] Exp(1); ``q`` [R, V] the
    draft distribution of each row's draft, None for one-hot."""
    t = to_device(temperature, x.dtype, x.device)[:, None]
    p = filter_logits(x / t, top_k, top_p, min_p).softmax(dim=-1)
    d = draft.clamp_min(0)[:, None]
    p_d = p.gather(1, d).squeeze(1)
    if q is None:
        q_d = torch.ones_like(p_d)
        residual = p.scatter(1, d, 0.0)
    else:
        q_d = q.gather(1, d).squeeze(1)
        residual = (p - q).clamp_min(0.0)
    residual = torch.where(has_draft[:, None], residual, p)
    kept = has_draft & accepts(p_d, q_d, uniform)
    given = (residual / noise.clamp_min(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)
    return kept, given


def verify(x: torch.Tensor, draft: torch.Tensor, sampled: list[int], temperature: list[float], top_k: list[int],
           top_p: list[float], min_p: list[float], uniform: torch.Tensor, noise: torch.Tensor,
           q: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of processed logits ``x`` [R, V], each with the draft that follows it in ``draft`` [R]
    (-1: none): per row whether the draft is kept, and the token the row gives where it is not.
    Greedy rows take the argmax; the rows ``sampled`` go through :func:`rejection_sample` with their
    settings, ``uniform`` and ``noise`` (and ``q``) given for those rows only."""
    has_draft = draft >= 0
    given = x.argmax(dim=-1)
    kept = has_draft & (given == draft)
    if sampled:
        idx = to_device(sampled, torch.int64, x.device)
        k, g = rejection_sample(x.index_select(0, idx), draft.index_select(0, idx), has_draft.index_select(0, idx),
                                temperature, top_k, top_p, min_p, uniform, noise, q)
        kept[idx], given[idx] = k, g
    return kept, given
