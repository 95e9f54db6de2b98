"""Speculative-decoding family: a proposer drafts tokens that the target model then verifies.

The interface issue 17 implements (n-gram, draft model, MTP, DSpark). The engine asks a proposer
for up to ``k`` draft tokens per sequence, runs the target once over them, accepts a prefix (greedy:
while equal to the target's argmax; sampled: by rejection sampling against ``Drafts.probs``) and
tells the proposer how many it kept, so a drafter with state of its own (a draft model's KV, a
DSpark block cache) can roll back the rest. The KV manager rolls back the target's pages.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class DraftRequest:
    """What a proposer sees of one sequence: its tokens so far and how many drafts it may return
    (a load-aware verify length sets ``k`` per request)."""

    seq_id: int
    token_ids: list[int]  # prompt and output so far
    k: int


@dataclass
class Drafts:
    """Per sequence up to ``k`` draft tokens, a chain; ``probs`` the draft distribution of each token,
    rows packed in sequence order, which rejection sampling needs (``None``: the proposer is
    deterministic, its distribution one-hot on the token, as n-gram lookup is); ``confidence``
    per draft the proposer's estimate that the target keeps it given it kept those before (DSpark's
    confidence head), from which a load-aware verify length is chosen (core/spec/verify_length.py)."""

    token_ids: list[list[int]]
    probs: torch.Tensor | None = None  # [sum of lengths, vocab]
    confidence: list[list[float]] | None = None  # one per draft, in [0, 1]

    def check(self, requests: list[DraftRequest]) -> None:
        """Raise ValueError naming the field when the drafts do not answer ``requests``."""
        if len(self.token_ids) != len(requests):
            raise ValueError(f"token_ids: {len(self.token_ids)} draft lists for {len(requests)} sequences")
        for req, ids in zip(requests, self.token_ids):
            if len(ids) > req.k:
                raise ValueError(f"token_ids: {len(ids)} drafts for sequence {req.seq_id}, at most k={req.k}")
        if self.confidence is not None and list(map(len, self.confidence)) != list(map(len, self.token_ids)):
            raise ValueError("confidence: not one per draft")
        rows = sum(map(len, self.token_ids))
        if self.probs is not None and (self.probs.dim() != 2 or self.probs.shape[0] != rows):
            raise ValueError(f"probs: shape {list(self.probs.shape)}, want [{rows}, vocab]")


class SpecProposer(ABC):
    """One drafting method; ``create(ctx)`` of an ``engine_register_spec_proposers`` descriptor builds it."""

    name: str = "?"
    feature: str | None = None  # a per-token feature of the target's (ForwardBatch.features) it drafts from
    feature_layers: tuple[int, ...] = ()  # target layers whose hidden states verification hands back (DSpark, MTP)
    # drafts come with confidence: the engine times its verify step at start-up and chooses each
    # request's verify length by load (core/spec/verify_length.py)
    load_aware: bool = False
    # prefill/decode disaggregation (core/disagg/payload.py): how many of a prompt's last computed
    # positions' features a decode engine's proposer needs to draft from a prompt it did not
    # compute, which the prefill engine sends with the KV (0: none move); ``carried_row`` elements
    # of ``carried_dtype`` each
    carried: int = 0
    carried_row: int = 0
    carried_dtype: torch.dtype = torch.float32

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx

    @abstractmethod
    def propose(self, requests: list[DraftRequest], features: torch.Tensor | None = None) -> Drafts:
        """Draft for every sequence of the step; ``features``: the target's hidden states of
        ``feature_layers`` at each sequence's last verified token, packed, when the proposer asks."""

    def idle(self) -> None:
        """A step in which this engine drafts nothing (``propose`` is not called). Under data-parallel
        attention a proposer whose forwards reach the MoE layers' exchanges (MTP) still meets the other
        ranks' drafting forwards here, with no tokens."""

    def lead(self, peers: Any) -> None:
        """Tensor parallelism: ``peers`` (the runner's, core/distributed/followers.py, workers.py) are
        the other processes of this one's attention group; a proposer whose forwards run the target's
        split layers (MTP) sends them each forward's host data, which they run (``follow``)."""

    def follow(self, message: Any) -> None:
        """On another process of the attention group: run a drafting message the leader sent."""

    def admit(self, seq_id: int, token_ids: list[int]) -> int:
        """The scheduler admits a sequence of ``token_ids`` (prompt and any output so far): how many
        of its first tokens the target may take from its prefix cache, rather than compute and
        ``observe``. A proposer that continues from the target's features only where it holds every
        position before (MTP) answers what it holds; the rest, all."""
        return len(token_ids)

    def page_rows(self) -> Any:
        """What it keeps per page of a token prefix that should cross the hierarchical cache's tiers
        with the target's pages (core/kv/page_rows.py's PageRows: DSpark's context rows), or None."""
        return None

    def reset_prefix_cache(self) -> None:
        """Drop what the proposer keeps across sequences and its lookup counts (after the start-up
        warm-up, as the target's prefix cache is)."""

    def observe(self, seq_id: int, start: int, features: torch.Tensor) -> None:
        """With ``feature``: the target computed positions ``start``.. of the sequence, with these
        features (one row each); positions it computes again (after drafts it rejected, or
        preemption) come again."""

    def settled(self, seq_id: int, token_ids: list[int], end: int) -> None:
        """After ``observe``: the sequence's positions before ``end`` are final (their tokens,
        ``token_ids[:end]``, will not change: a prompt's or kept tokens, not drafts), so what a
        proposer computed there may be kept for any sequence that starts with those tokens (DSpark's
        context rows, for prefix hits)."""

    def fork(self, parent_id: int, child_id: int) -> None:
        """An n > 1 sibling starts from its parent's computed prompt (the target's KV forked, not
        computed again): a proposer that drafts from the target's features gives the child the
        parent's features of the prompt, which the child's own steps continue."""

    def carried_features(self, seq_id: int, start: int, end: int) -> torch.Tensor | None:
        """Prefill side, with ``carried``: the features of positions ``start``..``end - 1`` of the
        sequence's prompt, or None where the target did not compute them all here (a prefix hit)."""
        return None

    def carry_in(self, seq_id: int, token_ids: list[int], start: int, features: torch.Tensor) -> None:
        """Decode side, with ``carried``: the sequence's prompt ``token_ids`` holds the KV of all
        but its last token, imported from a prefill engine with the features of positions ``start``..
        (its first step computes and ``observe``s the last)."""

    def accepted(self, seq_ids: list[int], num_accepted: list[int]) -> None:
        """How many drafts of each sequence the target kept; a stateful proposer drops the rest."""

    def release(self, seq_id: int) -> None:
        """The sequence is finished or aborted: free what the proposer holds for it."""
