"""Grammars under speculative decoding: a constrained sequence's drafts end at the first one its
grammar refuses, and each verify row is masked by the state the drafts before it lead to.

A draft the grammar refuses could never be kept (its row's mask forbids it), so it is not verified:
the drafts stop before it (as vLLM validates drafts against the grammar). Verifying k drafts takes
k + 1 masks: the matcher advances through the drafts, its mask filled before each and after the
last, and is rolled back, so it still holds only the tokens on the host; the engine feeds it the
kept drafts and the target's token as it applies them (core/engine.py), and so it ends holding
exactly those. Nothing in between reads it: a step with drafts is applied before the next is
scheduled (core/spec/speculator.py).
"""

from __future__ import annotations

from typing import Any

import torch

from .bitmask import allow_all, apply_bitmask


def accepted_prefix(matcher: Any, drafts: list[int]) -> int:
    """How many of ``drafts``, from the first, the grammar accepts in turn; the matcher is left as it was."""
    n = 0
    for t in drafts:
        if not matcher.accept_token(t):
            break
        n += 1
    if n:
        matcher.rollback(n)
    return n


def fill_draft_bitmasks(matcher: Any, drafts: list[int], mask: torch.Tensor, first: int) -> None:
    """Rows ``first`` .. ``first + len(drafts)`` of ``mask``: what the grammar allows after each prefix of
    ``drafts`` (none, one, .. all); the matcher is left as it was. After a drafted stop token the grammar
    has ended and its row is left allowing every token: the engine ends the sequence at the stop token
    and drops the token that row gives."""
    for j, t in enumerate(drafts):
        matcher.fill_next_token_bitmask(mask, first + j)
        if not matcher.accept_token(t):
            if j:
                matcher.rollback(j)
            raise ValueError(f"draft {j} ({t}) was not cut at the grammar's refusal")
    if not matcher.is_terminated():
        matcher.fill_next_token_bitmask(mask, first + len(drafts))
    if drafts:
        matcher.rollback(len(drafts))


def mask_verify_rows(logits: torch.Tensor, rows: list[tuple[Any, list[int], int]]) -> torch.Tensor:
    """``logits`` with each constrained sequence's verify rows masked: ``rows`` holds per sequence its
    matcher, its drafts and the index of its first row (its ``len(drafts) + 1`` rows follow)."""
    host = allow_all(sum(len(d) + 1 for _, d, _ in rows), logits.shape[1], logits.device)
    index: list[int] = []
    for matcher, drafts, first in rows:
        fill_draft_bitmasks(matcher, drafts, host, len(index))
        index.extend(range(first, first + len(drafts) + 1))
    return apply_bitmask(logits, index, host)
