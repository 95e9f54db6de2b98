"""Which captured graph a step replays, and through which bucket: one choice for decode, verify and
prefill graphs, agreed by every process where their batches differ.

A step may fit several kinds of graph: the decode graphs (one token a sequence), speculative
decoding's verify graphs (K+1 tokens a sequence) and the breakable prefill graphs (any step whose
tokens fit), preferred in that order. Under data-parallel attention the ranks' batches differ but
the MoE exchanges inside a graph are sized by its bucket (core/distributed/moe.py), so every
process must replay the same graph, same bucket, or all run eagerly. Before each step every process
offers, for each kind, the smallest bucket that holds its step (nothing scheduled: the smallest of
all; a step the kind does not hold: one past its largest), and one max all_reduce over a group on
the host (gloo: it waits for no device work, so the host still runs ahead of the device) gives the
plan: the first kind whose largest offer it holds, through that bucket; a process with nothing
scheduled replays it on padding only (SGLang pads its data-parallel ranks' batches to the largest
the same way). The ranks hold the same buckets of each kind (their captures stop together), so the
largest offer is a bucket every process holds.
"""

from __future__ import annotations

import bisect
from typing import Iterable, Protocol

import torch

from .distributed.group import ParallelGroup


class Graphs(Protocol):
    """What the choice needs of a kind of graph."""

    buckets: list[int]  # the sizes captured, ascending (sequences, or tokens for prefill graphs)

    def pad(self, bucket: int) -> None:
        """Replay ``bucket`` on padding only: this process's part of the other ranks' step."""


def smallest_holding(buckets: list[int], size: int) -> int:
    return buckets[bisect.bisect_left(buckets, size)]


class GraphChoice:
    def __init__(self, kinds: list[Graphs | None], agree: ParallelGroup | None = None) -> None:
        """``kinds``: the graphs in order of preference (None: not captured), the same kinds on every
        process; ``agree``: under data-parallel attention, the processes that replay one plan together,
        a group on the host (None or one process: the step is this process's alone)."""
        self.kinds = kinds
        self.agree = agree if agree is not None and agree.size > 1 else None

    def choose(self, sizes: Iterable[int | None]) -> tuple[Graphs, int] | None:
        """The graph and bucket this step replays, or None: eagerly. ``sizes``: per kind, the step's
        size in it (0: nothing scheduled here; None: the kind does not hold the step), read lazily:
        one process stops at the first kind that holds its step."""
        if self.agree is None:
            for g, s in zip(self.kinds, sizes):
                if s and g is not None:
                    return g, smallest_holding(g.buckets, s)
            return None
        held = [(g, s) for g, s in zip(self.kinds, sizes) if g is not None]
        if not held:
            return None
        offers = [g.buckets[-1] + 1 if s is None else smallest_holding(g.buckets, max(s, 1)) for g, s in held]
        busy = any(s != 0 for _, s in held)
        plan = self.agree.all_reduce(torch.tensor(offers + [int(busy)], dtype=torch.int64), "max").tolist()
        if not plan[-1]:  # no process has a batch: nothing to replay
            return None
        return next(((g, b) for (g, _), b in zip(held, plan) if b <= g.buckets[-1]), None)

    def idle(self) -> bool:
        """With nothing scheduled here: replay on padding what the other ranks replay; whether one was."""
        chosen = self.choose([0] * len(self.kinds))
        if chosen is not None:
            chosen[0].pad(chosen[1])
        return chosen is not None
