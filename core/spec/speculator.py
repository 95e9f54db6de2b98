"""Speculative decoding in the engine's step: drafts for the step's decodes, the target's logits
over them verified, the kept tokens handed to the engine and the rest rolled back.

The scheduler asks :meth:`Speculator.propose` for each decode's drafts (core/scheduler.py); a
decode with ``k`` drafts runs as a ragged row of its last token and the drafts, on pages reserved
for all of them, like a prefill chunk. :meth:`Speculator.verify` queues, from that row's ``k + 1``
logits rows, which drafts are kept and the token that follows them (core/spec/rejection.py), each
row sampled as the sequence would be with the drafts before it drawn (penalties, min_tokens,
seeds). :meth:`Verified.resolve` reads the outcome, rolls the rejected drafts' KV back through the
scheduler (the KV manager frees their pages; the prefix cache never holds them) and gives the
engine the kept tokens in order, whose endings by token it applies one at a time: a stop token or
max_tokens inside a kept run ends the output where it would without drafts, and the rest of the
run is dropped.

A sequence with a grammar (structured outputs) gets drafts too: they end before the first its
grammar refuses, and each of its rows is masked by the grammar's state after the drafts before it
(core/structured/drafts.py), so what is kept and given is what the sequence would draw without
drafts, from the allowed tokens only.

Drafts need each sequence's latest token on the host, so an engine with a proposer reads every
step's tokens before it schedules the next (no overlap, core/engine.py).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from ..families.spec import DraftRequest, SpecProposer
from ..host_copy import HostCopy
from ..structured.drafts import accepted_prefix, mask_verify_rows
from ..to_device import to_device
from . import rejection
from .counters import SpecCounters
from .verify_length import LoadAwareLength, choose_lengths

if TYPE_CHECKING:
    from ..sampler import Sampler
    from ..scheduler import ScheduledSeq, Scheduler
    from ..sequence import Sequence


class _Position:
    """One verified row as sampling reads it (core/sampler.py's SamplingRow): the sequence with the
    drafts before the row drawn."""

    __slots__ = ("seq", "before")
    in_flight = False
    slot = 0

    def __init__(self, seq: Sequence, before: list[int]) -> None:
        self.seq, self.before = seq, before

    @property
    def params(self):
        return self.seq.params

    @property
    def generator(self):
        return self.seq.generator

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.seq.prompt_token_ids

    @property
    def output_token_ids(self) -> list[int]:
        return self.seq.output_token_ids + self.before

    @property
    def num_output(self) -> int:
        return len(self.seq.output_token_ids) + len(self.before)


class _Kept:
    """The kept tokens of a step, one entry per token, read as the sampler's output is read."""

    def __init__(self, token_ids: list[int], logprobs: list[float] | None, top_logprobs: list) -> None:
        self.token_ids, self.logprobs, self.top_logprobs = token_ids, logprobs, top_logprobs


class Verified:
    """A step's verification on its way to the host."""

    def __init__(self, speculator: Speculator, rows: list[ScheduledSeq], kept: torch.Tensor, out) -> None:
        self.speculator, self.rows, self.out = speculator, rows, out
        self._kept = HostCopy([kept])

    def resolve(self, scheduler: Scheduler) -> tuple[list[Sequence], _Kept]:
        """Wait for the step; roll back what was rejected; the kept tokens, a sequence's in order."""
        kept = self._kept.tolist(0)
        tokens, logprobs, top = self.out.token_ids, self.out.logprobs, self.out.top_logprobs
        counters = self.speculator.counters
        per_position = counters.accepted_per_position
        seqs, keep, counts = [], [], []
        row = 0
        for s in self.rows:
            seq, n = s.seq, len(s.drafts)
            a = 0
            while a < n and kept[row + a]:
                per_position[a] += 1
                a += 1
            counts.append(a)
            if not seq.is_finished:
                scheduler.rewind(seq, s.context_len + 1 + a)  # its last token and the drafts kept
            seq.num_pending += a  # one was counted when launched; the engine counts each down
            seqs += [seq] * (a + 1)
            keep.extend(range(row, row + a + 1))
            row += n + 1
        counters.num_drafts += len(counts)
        counters.num_draft_tokens += row - len(counts)
        counters.num_accepted_tokens += sum(counts)
        self.speculator.proposer.accepted([s.seq.seq_id for s in self.rows], counts)
        return seqs, _Kept([tokens[i] for i in keep], [logprobs[i] for i in keep] if logprobs is not None else None,
                           [top[i] for i in keep])


class Speculator:
    def __init__(self, proposer: SpecProposer, num_speculative_tokens: int, sampler: Sampler, vocab_size: int) -> None:
        self.proposer = proposer
        self.k = num_speculative_tokens
        self.sampler = sampler
        self.vocab_size = vocab_size
        self.reset_counters()
        # drafts with confidence: each request's verify length chosen by load (verify_length.py)
        self.verify_length: LoadAwareLength | None = None
        self._probs: dict[int, torch.Tensor] = {}  # seq id -> draft distribution rows of this step's drafts

    def reset_counters(self) -> None:
        self.counters = SpecCounters(accepted_per_position=[0] * self.k)

    def propose(self, seqs: list[Sequence], budget: int) -> dict[int, list[int]]:
        """Drafts per sequence id for the decodes ``seqs`` (their latest token on the host), at most
        ``budget`` in all, none past what a sequence may still output (the target adds one). Called
        once every step (the scheduler's), with no decodes too: the proposer drafts or idles."""
        requests, drafting = [], []
        for seq in seqs:
            k = min(self.k, seq.max_output - len(seq.output_token_ids) - 1, budget)
            if k > 0:
                requests.append(DraftRequest(seq.seq_id, seq.tokens, k))
                drafting.append(seq)
                budget -= k
        load = self.verify_length
        if not requests or load is not None and not load.worth_drafting(len(requests), len(seqs) - len(requests)):
            self.proposer.idle()
            return {}
        started = time.perf_counter()
        drafts = self.proposer.propose(requests)
        drafts.check(requests)
        lengths = list(map(len, drafts.token_ids))
        if load is not None and drafts.confidence is not None:
            seconds = time.perf_counter() - started
            load.drafted(len(requests), seconds, drafts.confidence)
            lengths = choose_lengths(drafts.confidence, load.curve, seconds, len(seqs) - len(requests))
        out, self._probs, row = {}, {}, 0
        for req, seq, ids, n in zip(requests, drafting, drafts.token_ids, lengths):
            drafted, ids = ids, ids[:n]
            if not all(0 <= t < self.vocab_size for t in ids):
                raise ValueError(f"proposer {self.proposer.name} drafted ids outside [0, {self.vocab_size})")
            if seq.grammar is not None:  # none past the first its grammar refuses (core/structured/drafts.py)
                ids = ids[:accepted_prefix(seq.grammar, ids)]
            if ids:
                out[req.seq_id] = list(ids)
                if drafts.probs is not None:
                    self._probs[req.seq_id] = drafts.probs[row:row + len(ids)]
            row += len(drafted)
        return out

    def admit(self, seq: Sequence) -> int:
        """How many of an admitted sequence's first tokens its prefix hit may cover: as many as its
        proposer can continue drafting from."""
        return self.proposer.admit(seq.seq_id, seq.tokens)

    def observe(self, scheduled: list[ScheduledSeq], features: torch.Tensor) -> None:
        """Hand the proposer the target's features of the step's tokens, per sequence."""
        at = 0
        for s in scheduled:
            self.proposer.observe(s.seq.seq_id, s.context_len, features[at:at + s.num_new])
            at += s.num_new
            # a verify row's drafts are not final; a prefill chunk's and the last token's positions are
            self.proposer.settled(s.seq.seq_id, s.seq.tokens, min(s.context_len + s.num_new, s.seq.num_tokens))

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """An n > 1 sibling forked from its parent's prompt: so does its proposer state."""
        self.proposer.fork(parent.seq_id, child.seq_id)

    def release(self, seq: Sequence) -> None:
        """The sequence gave its KV back (finished, aborted or preempted): so does its proposer."""
        self.proposer.release(seq.seq_id)

    def verify(self, rows: list[tuple[ScheduledSeq, int]], logits: torch.Tensor) -> Verified:
        """Queue the verification of the scheduled rows with drafts, each with its first logits row."""
        dev, vocab = logits.device, logits.shape[1]
        index: list[int] = []
        after: list[int] = []  # per row the draft that follows it, -1 after the last
        positions: list[_Position] = []
        sampled: list[int] = []
        constrained: list[tuple] = []  # (matcher, drafts, first row) of the sequences with a grammar
        for s, start in rows:
            d = s.drafts
            n = len(d) + 1
            if s.seq.grammar is not None:
                constrained.append((s.seq.grammar, d, len(index)))
            if not s.seq.params.greedy:
                sampled.extend(range(len(index), len(index) + n))
            index.extend(range(start, start + n))
            after += d
            after.append(-1)
            positions += [_Position(s.seq, d[:j]) for j in range(n)]
            s.seq.num_pending += 1
        raw = logits.index_select(0, to_device(index, torch.int64, dev))
        if constrained:  # each row masked as the sampler masks a draw, by the state the drafts before it lead to
            raw = mask_verify_rows(raw, constrained)
        x = self.sampler.process(raw, positions)
        draft = to_device(after, torch.int64, dev)
        uniform = noise = q = None
        if sampled:
            # Exp(1) noise per token as the sampler draws it (a seeded row's from its own generator),
            # one column more: exp(-E) of it is U(0, 1], the draw that keeps or rejects the row's draft
            noise = self.sampler.noise(x.new_empty(len(sampled), vocab + 1), [positions[i] for i in sampled])
            uniform, noise = torch.exp(-noise[:, -1]), noise[:, :-1]
            q = self._draft_probs(rows, vocab, dev)
        params = [positions[i].params for i in sampled]
        kept, given = rejection.verify(x, draft, sampled, [p.temperature for p in params], [p.top_k for p in params],
                                       [p.top_p for p in params], [p.min_p for p in params], uniform, noise, q)
        emitted = torch.where(kept, draft, given)
        return Verified(self, [s for s, _ in rows], kept, self.sampler.output(raw, emitted, positions))

    def _draft_probs(self, rows: list[tuple[ScheduledSeq, int]], vocab: int, dev: torch.device) -> torch.Tensor | None:
        """The draft distribution of the sampled rows (one-hot where the proposer gave none; a last
        row's, after the drafts, zero), or None where every draft is one-hot."""
        if not self._probs:
            return None
        parts = []
        for s, _ in rows:
            if s.seq.params.greedy:
                continue
            q = self._probs.get(s.seq.seq_id)
            if q is None:
                q = torch.nn.functional.one_hot(to_device(s.drafts, torch.int64, dev), vocab).float()
            parts += [q.to(dev, torch.float32), torch.zeros(1, vocab, device=dev)]
        return torch.cat(parts)
