"""Continuous batching: which sequences run this step, how many tokens each, on which pages.

Each step first serves running sequences in arrival order (decodes always; unfinished prefills
take chunks), then admits waiting ones FCFS while pages, sequence slots and the prefill token
budget allow. When a running sequence needs a page and none is free, unlocked prefix-cache
entries are evicted first, then the latest-arrived running sequence is preempted: its pages are
freed and it goes back to the head of the queue to be recomputed (its outputs so far are kept).
Where the model has windowed components (core/kv/window.py), a sequence also holds the window
pages of the pages within reach of its end, and a shortage of those is met the same way: first
the prefix cache's windows are let go, then a sequence is preempted. Pages, windows and the prefix
cache are the KV manager's (core/kv/manager.py): the scheduler asks it and never reaches in.

A step is scheduled before the tokens of the step in flight reach the host (core/engine.py): a
sequence with a token still on the device decodes it from the token table, and one whose token in
flight ends it by length is not scheduled again. A running sequence holds a slot of that table.

With speculative decoding (core/spec/speculator.py) a decode brings the drafts its proposer gives
it, within the step's token budget; where pages run short, drafts give way before anyone is
preempted. The drafts the target rejects are rolled back (``rewind``). An admitted sequence's
prefix hit ends where its proposer can draft after (``Speculator.admit``: MTP continues only from
the positions its own cache holds), where that recomputes at most RECOMPUTE_FOR_DRAFTS_PAGES pages.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

import msgspec

from .config import EngineConfig
from .kv.manager import KVManager, SeqKV
from .sequence import SeqStatus, Sequence
from .spec.speculator import Speculator
from .token_table import TokenTable

logger = logging.getLogger(__name__)


class ScheduledSeq(msgspec.Struct):
    """One sequence's part of a step (a Struct: one is made per sequence per step, in C). What it
    draws is decided once, when scheduled: the runner and the engine both read it."""

    seq: Sequence
    num_new: int  # tokens computed this step, starting at seq.num_computed
    context_len: int  # seq.num_computed when scheduled
    kv: SeqKV  # its KV state: the page list and its row of the page table
    in_flight: bool  # a decode whose input token is still on the device only (in the token table)
    samples: bool  # the step reaches the last token (on the host or in flight): one is drawn
    needs_all_logits: bool  # prompt logprobs: a logits row for every prompt position of the chunk
    drafts: list[int] | None = None  # a decode's speculative drafts, computed after its last token

    @classmethod
    def of(cls, seq: Sequence, num_new: int, kv: SeqKV) -> ScheduledSeq:
        """``num_new`` tokens of ``seq`` from where it is."""
        ctx = seq.num_computed
        return cls(seq, num_new, ctx, kv, seq.num_pending > 0, ctx + num_new >= seq.num_tokens,
                   seq.wants_prompt_logprobs and ctx < len(seq.prompt_token_ids) - 1)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    page_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) before the forward

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new for s in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    num_steps: int = 0


# A prefix hit is cut back to where the proposer can draft after (MTP: the positions its own cache
# holds; a second chat turn lacks a page or so) only where that recomputes this many pages or
# fewer. Further back (the proposer's cache evicted, a hit loaded from host memory or storage, which
# hold the target's KV alone) the target keeps its hit and the sequence goes without drafts.
RECOMPUTE_FOR_DRAFTS_PAGES = 4


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVManager, table: TokenTable,
                 speculator: Speculator | None = None, replay_tail: int = 0) -> None:
        """``replay_tail``: the model's (CausalLM.replay_tail), the tokens a prefix hit leaves to compute."""
        self.config = config
        self.replay_tail = replay_tail
        self.kv = kv
        self.table = table
        self.speculator = speculator
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.fork_pending: dict[str, list[Sequence]] = {}  # request id -> siblings of n > 1
        self.stats = SchedulerStats()

    # -- queue management -------------------------------------------------------------------

    def add(self, seqs: list[Sequence]) -> None:
        """Queue a request's sequences; for n > 1 only the first computes the prompt."""
        first = seqs[0]
        first.status = SeqStatus.WAITING
        self.waiting.append(first)
        if not first.wants_prompt_logprobs:  # what _match_prefix will look up, read from storage meanwhile
            self.kv.prefetch(first.tokens[:first.num_tokens - 1])
        self._pend_siblings(seqs)

    def add_computed(self, seqs: list[Sequence], num_computed: int) -> None:
        """Run a request whose first sequence already holds the KV of ``num_computed`` tokens
        (imported from another engine: core/disagg/decode.py) from the next step; a slot must be free."""
        seqs[0].num_computed = num_computed
        self._run(seqs[0])
        self._pend_siblings(seqs)

    def _pend_siblings(self, seqs: list[Sequence]) -> None:
        """n > 1: the siblings wait for the first sequence's prompt, then fork from it."""
        first, rest = seqs[0], seqs[1:]
        if rest:
            for s in rest:
                s.status = SeqStatus.FORK_PENDING
            self.fork_pending[first.request_id] = list(rest)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + sum(len(v) for v in self.fork_pending.values())

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, request_id: str) -> list[Sequence]:
        """Drop every sequence of the request wherever it is, freeing its pages now."""
        aborted = [s for s in self.running if s.request_id == request_id]
        aborted += [s for s in self.waiting if s.request_id == request_id]
        aborted += self.fork_pending.pop(request_id, [])
        for s in aborted:
            self.finish(s, "abort", cache=False)
        return aborted

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None, cache: bool = True) -> None:
        if seq.is_finished:
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq, cache=cache)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        if seq.index == 0 and reason == "abort":
            self.fork_pending.pop(seq.request_id, None)

    # -- KV ---------------------------------------------------------------------------------

    def _release(self, seq: Sequence, cache: bool) -> None:
        """Give back a sequence's pages and slot; its computed full pages go to the prefix cache first."""
        self.kv.free(seq, cache=cache)
        if self.speculator is not None:
            self.speculator.release(seq)
        seq.num_computed = 0
        self.table.release(seq.slot)
        seq.slot = 0

    def _run(self, seq: Sequence) -> None:
        seq.status = SeqStatus.RUNNING
        seq.slot = self.table.assign()
        self.running.append(seq)

    def computed(self, s: ScheduledSeq) -> None:
        """A scheduled step's tokens are computed (their KV written): the sequence moves past them."""
        s.seq.num_computed = s.context_len + s.num_new
        self.kv.commit(s.seq, s.seq.num_computed)

    def rewind(self, seq: Sequence, num_computed: int) -> None:
        """Forget the KV past ``num_computed`` tokens (drafts the target rejected): the KV manager
        frees their pages, and the sequence reads what it would had they never been computed."""
        seq.num_computed = num_computed
        self.kv.rollback(seq, num_computed)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq, cache=True)
        seq.status = SeqStatus.WAITING
        self.stats.num_preemptions += 1
        self.waiting.appendleft(seq)
        logger.debug("preempted %s (seq %d) to recompute later", seq.request_id, seq.seq_id)

    def fork(self, parent: Sequence) -> list[Sequence]:
        """Start the n > 1 siblings from the parent's computed prompt, sharing its full pages.

        The partial last page is copied (the runner applies ``page_copies`` before the next
        forward), since each sibling writes its own tokens there. A sibling that cannot get a page
        waits and recomputes instead.
        """
        siblings = self.fork_pending.pop(parent.request_id, [])
        prompt_len = len(parent.prompt_token_ids)
        for s in siblings:
            if not self.kv.fork(parent, s, prompt_len):
                s.status = SeqStatus.WAITING
                self.waiting.append(s)
                continue
            if self.speculator is not None:
                self.speculator.fork(parent, s)
            s.num_computed = prompt_len
            s.first_scheduled_time = parent.first_scheduled_time
            self._run(s)
        return siblings

    # -- the step -----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        cfg = self.config
        running, scheduled = self.running, out.scheduled
        # per running sequence, once: whether its token in flight is its last (it ends by length:
        # nothing to compute), whether it prefills. A preemption below removes only later
        # sequences, so kinds[i] stays running[i]'s.
        kinds = [(s.num_pending > 0 and s.reaches_length(s.num_pending), s.in_prefill) for s in running]
        decode_tokens = kinds.count((False, False))
        drafts = None
        if self.speculator is not None:
            # decodes with their latest token on the host and an output (the first token, where n > 1
            # siblings fork, is drawn from the prompt alone)
            decodes = [s for s, kind in zip(running, kinds)
                       if kind == (False, False) and not s.num_pending and s.output_token_ids]
            drafts = self.speculator.propose(decodes, cfg.max_num_batched_tokens - decode_tokens)
            decode_tokens += sum(map(len, drafts.values()))
        prefill_budget = max(cfg.max_num_batched_tokens - decode_tokens, 0)
        if cfg.chunk_size:
            prefill_budget = min(prefill_budget, cfg.chunk_size)

        i = 0
        while i < len(running):
            seq = running[i]
            drawn_out, prefilling = kinds[i]
            if drawn_out:
                i += 1
                continue
            if prefilling:
                if prefill_budget <= 0:
                    i += 1
                    continue
                remaining = seq.num_tokens - seq.num_computed
                num_new = min(remaining, prefill_budget) if cfg.chunk_size else remaining
            else:
                d = drafts.get(seq.seq_id) if drafts else None
                num_new = 1 + len(d) if d else 1
            while (kv := self.kv.allocate(seq, num_new)) is None:
                if not prefilling and d:  # drafts give way first
                    d, num_new = None, 1
                    continue
                victim = running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if kv is None:
                continue  # preempted itself; ``i`` now points at the next sequence
            if prefilling:
                prefill_budget -= num_new
                scheduled.append(ScheduledSeq.of(seq, num_new, kv))
            else:  # a decode reaches its last token and no prompt position: it draws one (and verifies its drafts)
                scheduled.append(ScheduledSeq(seq, num_new, seq.num_computed, kv, seq.num_pending > 0, True, False, d))
            i += 1

        if not out.preempted:
            self._admit(out, prefill_budget)
        out.page_copies = self.kv.take_page_copies()
        self.stats.num_steps += 1
        return out

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        cfg = self.config
        while self.waiting and len(self.running) < cfg.max_num_seqs:
            seq = self.waiting[0]
            if budget <= 0 or seq.num_pending:  # a sibling whose first token is still in flight waits a step
                break
            self._match_prefix(seq)  # waiting sequences hold no pages
            remaining = seq.num_tokens - seq.num_computed
            if cfg.chunk_size:
                num_new = min(remaining, budget)
            elif remaining <= budget or not out.scheduled:
                num_new = remaining  # chunking off: whole prompts, one may exceed the budget alone
            else:
                self._release(seq, cache=False)  # it waits for a step with room, holding nothing
                break
            kv = self.kv.allocate(seq, num_new)
            if kv is None:
                self._release(seq, cache=False)
                break
            self.waiting.popleft()
            # a lookup counts once, when admitted, however many steps the sequence waited
            self.kv.record_lookup(seq.num_tokens - 1, seq.num_cached)
            self._run(seq)
            out.scheduled.append(ScheduledSeq.of(seq, num_new, kv))
            budget -= num_new

    def _match_prefix(self, seq: Sequence) -> None:
        """Start from the longest cached prefix, leaving at least one token (the model's replay tail, if
        longer) to compute; cut back to where the proposer, if any, can draft after, where that
        recomputes few pages."""
        seq.num_cached = 0
        if seq.wants_prompt_logprobs:
            return  # prompt logprobs need the logits of every prompt position
        hit = self.kv.match_prefix(seq, seq.tokens[:max(0, seq.num_tokens - max(1, self.replay_tail))])
        if hit and self.speculator is not None:
            drafts_from = self.speculator.admit(seq)
            if drafts_from < hit <= drafts_from + RECOMPUTE_FOR_DRAFTS_PAGES * self.kv.page_size:
                self.kv.free(seq, cache=False)
                hit = self.kv.match_prefix(seq, seq.tokens[:drafts_from])
        seq.num_computed = seq.num_cached = hit
