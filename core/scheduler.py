"""Continuous batching: which sequences run this step, how many tokens each, on which pages.

Each step first serves running sequences in arrival order (decodes always; unfinished prefills
take chunks), then admits waiting ones FCFS while pages, sequence slots and the prefill token
budget allow. When a running sequence needs a page and none is free, unlocked prefix-cache
entries are evicted first, then the latest-arrived running sequence is preempted: its pages are
freed and it goes back to the head of the queue to be recomputed (its outputs so far are kept).
Where the model has windowed components (core/kv/window.py), a sequence also holds the window
pages of the pages within reach of its end, and a shortage of those is met the same way: first
the prefix cache's windows are let go, then a sequence is preempted.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from .config import EngineConfig
from .kv.pages import PagePool
from .kv.radix import RadixCache
from .kv.window import WindowPool
from .sequence import SeqStatus, Sequence

logger = logging.getLogger(__name__)


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new: int  # tokens computed this step, starting at seq.num_computed
    context_len: int  # seq.num_computed when scheduled
    ahead: bool = False  # a lookahead decode: its input token is the one still on the device

    @property
    def samples(self) -> bool:
        """The step reaches the sequence's last token, so a new token is drawn."""
        return self.ahead or self.context_len + self.num_new == self.seq.num_tokens

    @property
    def needs_all_logits(self) -> bool:
        """Prompt logprobs want a logits row for every prompt position of the chunk."""
        return self.seq.wants_prompt_logprobs and self.context_len < len(self.seq.prompt_token_ids) - 1


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


class Scheduler:
    def __init__(self, config: EngineConfig, pool: PagePool, radix: RadixCache, window: WindowPool | None = None) -> None:
        self.config = config
        self.pool = pool
        self.radix = radix
        self.window = window
        self.page_size = config.page_size
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.fork_pending: dict[str, list[Sequence]] = {}  # request id -> siblings of n > 1
        self.pending_copies: list[tuple[int, int]] = []
        self.stats = SchedulerStats()

    # -- queue management -------------------------------------------------------------------

    def add(self, seqs: list[Sequence]) -> None:
        """Queue a request's sequences; for n > 1 only the first computes the prompt."""
        first, rest = seqs[0], seqs[1:]
        first.status = SeqStatus.WAITING
        self.waiting.append(first)
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

    # -- pages --------------------------------------------------------------------------------

    def _pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def _allocate(self, seq: Sequence, upto_tokens: int) -> bool:
        need = self._pages_for(upto_tokens) - len(seq.pages)
        if need > 0:
            if self.pool.num_free < need:
                self.radix.evict(need - self.pool.num_free)
            if self.pool.num_free < need:
                return False
            seq.pages.extend(self.pool.alloc(need))
        return self._hold_windows(seq, upto_tokens)

    def _hold_windows(self, seq: Sequence, upto_tokens: int) -> bool:
        """Move the sequence's held windows to what a step up to ``upto_tokens`` reads (its pages exist)."""
        if self.window is None:
            return True
        a, b = self.window.span(seq.num_computed, upto_tokens, self.page_size)
        a0, b0 = seq.window_span
        gain = [seq.pages[i] for i in range(a, b) if not a0 <= i < b0]
        need = self.window.missing(gain)
        if need > self.window.num_free and not self.radix.release_windows(need):
            return False
        self.window.hold(gain)
        self.window.let_go([seq.pages[i] for i in range(a0, b0) if not a <= i < b])
        seq.window_span = (a, b)
        return True

    def _let_go_windows(self, seq: Sequence) -> None:
        if self.window is not None:
            a, b = seq.window_span
            self.window.let_go(seq.pages[a:b])
        seq.window_span = (0, 0)

    def _release(self, seq: Sequence, cache: bool) -> None:
        """Give back a sequence's pages; its computed full pages go to the prefix cache first."""
        if seq.pages:
            if cache and self.radix.enabled:
                self.radix.insert(seq.tokens[: seq.num_computed], seq.pages)
            self._let_go_windows(seq)
            self.pool.decref(seq.pages)
        if seq.prefix_node is not None:
            self.radix.unlock(seq.prefix_node)
        seq.pages = []
        seq.prefix_node = None
        seq.num_computed = 0
        seq.inserted_prompt = False

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq, cache=True)
        seq.status = SeqStatus.WAITING
        self.stats.num_preemptions += 1
        self.waiting.appendleft(seq)
        logger.debug("preempted %s (seq %d) to recompute later", seq.request_id, seq.seq_id)

    def cache_prompt(self, seq: Sequence) -> None:
        """Once a prompt is computed, publish its pages so concurrent requests can share them."""
        if seq.inserted_prompt or not self.radix.enabled:
            return
        prompt = seq.prompt_token_ids
        self.radix.insert(prompt, seq.pages)
        node = self.radix.lock_prefix(prompt)
        if seq.prefix_node is not None:
            self.radix.unlock(seq.prefix_node)
        seq.prefix_node = node
        seq.inserted_prompt = True

    def fork(self, parent: Sequence) -> list[Sequence]:
        """Start the n > 1 siblings from the parent's computed prompt, sharing its full pages.

        The partial last page is copied (the runner applies ``page_copies`` before the next
        forward), since each sibling writes its own tokens there. A sibling that cannot get a page
        waits and recomputes instead.
        """
        siblings = self.fork_pending.pop(parent.request_id, [])
        prompt_len = len(parent.prompt_token_ids)
        full = prompt_len // self.page_size
        partial = prompt_len % self.page_size != 0
        for s in siblings:
            shared = parent.pages[:full]
            self.pool.incref(shared)
            s.pages = list(shared)
            if partial:
                if self.pool.num_free < 1:
                    self.radix.evict(1)
                if self.pool.num_free < 1:
                    self._wait_to_recompute(s)
                    continue
                dst = self.pool.alloc(1)[0]
                self.pending_copies.append((parent.pages[full], dst))
                s.pages.append(dst)
            s.num_computed = prompt_len
            if not self._hold_windows(s, prompt_len):  # the partial page copy reaches its window page too
                self._wait_to_recompute(s)
                continue
            s.status = SeqStatus.RUNNING
            s.first_scheduled_time = parent.first_scheduled_time
            self.running.append(s)
        return siblings

    def _wait_to_recompute(self, seq: Sequence) -> None:
        self._let_go_windows(seq)
        self.pool.decref(seq.pages)
        seq.pages = []
        seq.num_computed = 0
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    # -- the step -----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        cfg = self.config
        num_decodes = sum(1 for s in self.running if not s.in_prefill)
        prefill_budget = max(cfg.max_num_batched_tokens - num_decodes, 0)
        if cfg.chunk_size:
            prefill_budget = min(prefill_budget, cfg.chunk_size)

        i = 0
        while i < len(self.running):
            seq = self.running[i]
            remaining = seq.num_tokens - seq.num_computed
            prefilling = seq.in_prefill
            if prefilling:
                if prefill_budget <= 0:
                    i += 1
                    continue
                num_new = min(remaining, prefill_budget) if cfg.chunk_size else remaining
            else:
                num_new = 1
            while not self._allocate(seq, seq.num_computed + num_new):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted itself; ``i`` now points at the next sequence
            if prefilling:
                prefill_budget -= num_new
            out.scheduled.append(ScheduledSeq(seq, num_new, seq.num_computed))
            i += 1

        if not out.preempted:
            self._admit(out, prefill_budget)
        out.page_copies, self.pending_copies = self.pending_copies, []
        self.stats.num_steps += 1
        return out

    def extend_decodes(self, seqs: list[Sequence]) -> SchedulerOutput | None:
        """The next decode step of ``seqs`` scheduled before their last tokens reach the host: each
        computes the token at ``num_computed``, which is on the device. None where that step would
        leave out anything an ordinary step serves (a running sequence not in ``seqs``, a waiting
        request, a fork, a page copy) or need more than free pages (a preemption)."""
        if self.waiting or self.fork_pending or self.pending_copies or set(self.running) != set(seqs):
            return None
        for seq in seqs:
            if not self._allocate(seq, seq.num_computed + 1):
                return None  # pages taken so far are the ones the next ordinary step needs
        self.stats.num_steps += 1
        return SchedulerOutput([ScheduledSeq(s, 1, s.num_computed, ahead=True) for s in seqs])

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        cfg = self.config
        while self.waiting and len(self.running) < cfg.max_num_seqs:
            seq = self.waiting[0]
            if budget <= 0:
                break
            self._match_prefix(seq)  # waiting sequences hold no pages
            remaining = seq.num_tokens - seq.num_computed
            if cfg.chunk_size:
                num_new = min(remaining, budget)
            elif remaining <= budget or not out.scheduled:
                num_new = remaining  # chunking off: whole prompts, one may exceed the budget alone
            else:
                break
            if not self._allocate(seq, seq.num_computed + num_new):
                self._release(seq, cache=False)
                break
            self.waiting.popleft()
            # a lookup counts once, when admitted, however many steps the sequence waited
            self.radix.record(seq.num_tokens - 1, seq.num_cached)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, num_new, seq.num_computed))
            budget -= num_new

    def _match_prefix(self, seq: Sequence) -> None:
        """Start from the longest cached prefix, leaving at least one token to compute."""
        seq.num_cached = 0
        if seq.wants_prompt_logprobs:
            return  # prompt logprobs need the logits of every prompt position
        match = self.radix.match(seq.tokens[: seq.num_tokens - 1], record=False)
        if match.num_tokens == 0:
            return
        self.radix.lock(match.node)
        self.pool.incref(match.pages)
        seq.prefix_node = match.node
        seq.pages = list(match.pages)
        seq.num_computed = match.num_tokens
        seq.num_cached = match.num_tokens
        if self.window is not None:  # the match keeps every window within reach of its end: hold them now
            seq.window_span = self.window.span(match.num_tokens, match.num_tokens, self.page_size)
            self.window.hold(seq.pages[slice(*seq.window_span)])
