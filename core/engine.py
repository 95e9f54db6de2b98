"""The engine loop: add requests, run steps, hand back outputs. Owns the device.

``EngineCore.step_outputs()`` schedules and launches a forward and its sampling, then applies
the stop rules that need no text to the tokens of the step before it, and returns typed deltas
(``EngineCoreOutput``); the engine process sends those as they are. ``LLMEngine`` is the core read through an ``OutputProcessor`` (text, stop strings),
returning ``RequestOutput``s. It is synchronous and single-threaded by design; the async and
server layers drive it from their own loop.
"""

from __future__ import annotations

import itertools
import logging
import sys
import time
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection

import torch

from .config import EngineConfig
from .context import check_context
from .distributed.dp_attention import DataParallelRanks
from .distributed.followers import Followers
from .distributed.group import Rendezvous
from .distributed.workers import Workers
from .engine_stats import EngineCounters, EngineStats
from .errors import EngineError, InvalidRequest
from .output_processor import OutputProcessor
from .outputs import EngineCoreOutput, RequestOutput
from .plugins import Plugins
from .request import Request
from .runner import ModelRunner, StepLogits
from .sampler import PromptLogprobs, Sampler, SamplerOutput
from .sampling_params import SamplingParams
from .scheduler import ScheduledSeq, Scheduler, SchedulerStats
from .sequence import SeqStatus, Sequence
from .spec.speculator import Speculator, Verified
from .registry import SelectionError
from .startup import attach_storage_tier, build
from .structured.compiler import GrammarCompiler, GrammarHandle
from .to_device import to_device
from .token_table import TokenTable
from .spec.verify_length import LoadAwareLength, profile_verify
from .warmup import WarmupReport, warm_up, warm_up_sampling
from .tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass
class _StepTokens:
    """A step's sampled sequences (one row each, in order) and their draws, and the prompt logprobs
    its chunks computed, on their way to the host."""

    seqs: list[Sequence]
    tokens: SamplerOutput | None
    prompt: list[tuple[Sequence, PromptLogprobs]]
    verified: Verified | None = None  # the decodes with drafts (core/spec/speculator.py)


def _seed_generator(seed: int, index: int, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed((seed + index * 0x9E3779B97F4A7C15) % 2**63)
    return g


class EngineCore:
    """The engine without text: token ids in, typed deltas out. Stop strings are its reader's to
    find (output_processor.py), and its reader ends such a completion with ``finish_sequence``."""

    def __init__(self, config: EngineConfig, plugins: Plugins | None = None, progress: bool = True,
                 rendezvous: Rendezvous | None = None, followers: list[Connection] | None = None) -> None:
        """``rendezvous``: this core is a data-parallel rank other than 0, started by rank 0
        (core/distributed/dp_attention.py), and ``followers`` the sockets to the other processes of its
        rank; else it is rank 0 and spawns the others, if any."""
        self.config = config
        # under tensor parallelism this process is rank 0 and spawns the others (core/distributed)
        self.workers = Workers(config) if config.tensor_parallel_size > 1 and rendezvous is None else None
        try:
            c = build(config, plugins, progress=progress,
                      rendezvous=rendezvous or (self.workers.rendezvous if self.workers is not None else None))
            if self.workers is not None:
                self.workers.ready(c.group, c.attention_group, c.plan_group)
        except BaseException:
            self.shutdown()
            raise
        self.components = c
        self.model_config = c.model_config
        self.max_model_len = c.max_model_len
        self.device = c.device
        self.tokenizer = Tokenizer.from_dir(c.model_config.path)
        self.vocab_size = c.model_config.vocab_size
        self.kv_manager = c.kv_manager
        self.token_table = TokenTable(config.max_num_seqs, c.device)
        self.sampler = Sampler(self.vocab_size, self.tokenizer.eos_token_ids, self.token_table, c.sampling,
                               config.seed)
        self.speculator = None
        if c.proposer is not None:
            self.speculator = Speculator(c.proposer, config.speculative_config.num_speculative_tokens, self.sampler,
                                         self.vocab_size)
        # drafts are proposed from each sequence's latest token, and a model that reads each step's ids on
        # the host (host-placed Engram) needs them there: with either, every step is read first
        self.overlap = config.overlap_decode and self.speculator is None and not c.model.token_history
        self.scheduler = Scheduler(config, c.kv_manager, self.token_table, self.speculator, c.model.replay_tail)
        # data-parallel attention: each rank runs its own batches, rank 0 routes requests to the others
        self.idle_steps = config.enable_dp_attention  # every step runs a forward, with no tokens if need be
        self.dp = (DataParallelRanks(self.workers, config, c.kv_manager.num_pages)
                   if self.idle_steps and self.workers is not None else None)
        peers = self.workers  # every other rank follows this one's steps, or under DP attention those of its rank
        if self.idle_steps:
            peers = None
            if self.workers is not None and config.attention_tp_size > 1:
                peers = Followers(self.workers.conns[:config.attention_tp_size - 1], self.workers)
            elif followers:
                peers = Followers(followers)
        self.runner = ModelRunner(c.model, c.kv, self.token_table, c.kv_manager.page_table, config.page_size,
                                  c.device, c.graphs, c.attention_group, peers, c.prefill_graphs, c.verify_graphs,
                                  c.plan_group)
        if c.proposer is not None:
            if c.proposer.feature is not None and c.model.replay_tail:
                raise ValueError(f"enable_swa_bounded_replay: the {config.speculative_config.method} proposer drafts "
                                 f"from every prompt token's {c.proposer.feature!r} feature, which a bounded replay "
                                 f"computes only for the last {c.model.replay_tail} tokens")
            if peers is not None:  # the other processes of this one's attention group draft with it
                c.proposer.lead(peers)
            self.runner.feature = c.proposer.feature
            self.runner.feature_layers = c.proposer.feature_layers
            if rendezvous is None:  # another data-parallel rank's is timed once rank 0 times its own
                self.time_verify_step()
        self.requests: dict[str, Request] = {}
        self.failures: list[tuple[str, EngineError]] = []  # requests that failed after admission (take_failures)
        self.counters = EngineCounters()
        self._seq_ids = itertools.count()
        self._in_flight: _StepTokens | None = None  # the step launched last, its tokens not yet applied
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size, config.grammar_compile_timeout,
                                        config.grammar_cache_memory)  # structured outputs: nothing loads until used
        self._awaiting_grammar: dict[str, GrammarHandle] = {}  # requests whose grammar still compiles
        self.warmup: WarmupReport | None = None
        if config.warmup if config.warmup is not None else self.device.type == "cuda":
            if rendezvous is None:
                self.warmup = warm_up(self, progress)
            else:  # another data-parallel rank: rank 0's warm-up runs its steps, with requests of its own
                warm_up_sampling(self)

    # -- requests -----------------------------------------------------------------------------

    def time_verify_step(self) -> None:
        """A proposer that chooses verify lengths by load gets the verify step's curve, timed here.
        Under data-parallel attention each timed step's MoE exchanges meet the other ranks', so every
        rank times it at once: rank 0 once the others are up, the others once they said so."""
        if self.speculator is not None and self.speculator.proposer.load_aware:
            self.speculator.verify_length = LoadAwareLength(profile_verify(self, self.speculator.k),
                                                            self.speculator.k)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ``InvalidRequest`` naming the field for anything this engine cannot serve."""
        if not prompt_token_ids:
            raise InvalidRequest("prompt", "must not be empty")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequest("prompt", f"token ids must be in [0, {self.vocab_size}); got {bad[:5]}")
        params.validate_against(self.vocab_size)
        check_context(len(prompt_token_ids), params.max_tokens, self.max_model_len, params.min_tokens)

    def add_request(self, request_id: str, ids: list[int], params: SamplingParams,
                    rank: int | None = None) -> Request | None:
        """Queue a request; every step that changes it reports it. Under data-parallel attention it
        may go to another rank (None here): ``rank``, else the one the router places it on."""
        if request_id in self.requests or (self.dp is not None and self.dp.owns(request_id)):
            raise InvalidRequest("request_id", f"{request_id!r} is already in use")
        self.validate(ids, params)
        if self.dp is not None and rank is None:
            rank = self.dp.place(ids, len(self.requests))
        if rank:
            self.dp.add(rank, request_id, ids, params)
            self.counters.prompt_tokens += len(ids)
            return None
        max_output = min(params.max_tokens or sys.maxsize, self.max_model_len - len(ids) + 1)
        ending = params.ending_ids(self.tokenizer.eos_token_ids)
        seqs = [
            Sequence(next(self._seq_ids), request_id, i, ids, params,
                     generator=_seed_generator(params.seed, i, self.device) if params.seed is not None else None,
                     logprobs=[] if params.logprobs is not None else None,
                     prompt_logprobs=[None] if params.prompt_logprobs is not None and i == 0 else None,
                     max_output=max_output, ending_ids=ending)
            for i in range(params.n)
        ]
        req = Request(request_id, ids, params, seqs)
        self.requests[request_id] = req
        if params.structured_outputs is not None:  # queued once its grammar compiled, off this loop
            self._awaiting_grammar[request_id] = self.grammars.request(params.structured_outputs)
        else:
            self._queue(req)
        self.counters.prompt_tokens += len(ids)
        return req

    def _queue(self, req: Request) -> None:
        """Hand a new request's sequences to the scheduler."""
        self.scheduler.add(req.seqs)

    def take_failures(self) -> list[tuple[str, EngineError]]:
        """(request id, error) of the requests that failed after admission since the last call; they
        are gone from the engine, and their callers get the error instead of an output."""
        failures, self.failures = self.failures, []
        return failures

    def check_grammar(self, params: SamplingParams) -> None:
        """Compile the grammar ``params`` ask for, blocking the caller (never the engine loop), so a
        grammar that does not compile in time is refused as the request is made (``InvalidRequest``
        naming the field); the engine then finds it in the cache."""
        if params.structured_outputs is not None:
            self.grammars.request(params.structured_outputs).wait()

    def _admit_grammars(self) -> None:
        """Schedule the requests whose grammar compiled, each sequence with its own matcher; end those
        whose grammar failed, to ``failures`` (``check_grammar`` and the API process refuse them first,
        so only a compile past its time limit here, on a busy host, fails so). With nothing else to run, wait a moment for a compile."""
        if not self.scheduler.has_work() and self._in_flight is None:
            next(iter(self._awaiting_grammar.values())).settle(0.01)
        for rid, handle in list(self._awaiting_grammar.items()):
            try:
                compiled = handle.poll()
            except InvalidRequest as exc:
                logger.warning("request %s failed: its grammar in the engine: %s", rid, exc)
                del self._awaiting_grammar[rid]
                del self.requests[rid]
                self.failures.append((rid, exc))
                continue
            if compiled is not None:
                del self._awaiting_grammar[rid]
                req = self.requests[rid]
                for s in req.seqs:
                    s.grammar = self.grammars.matcher(compiled)
                self._queue(req)

    # -- the storage tier at run time (called between steps) ---------------------------------------

    def attach_storage(self, backend: str, directory: str | None = None, prefetch_policy: str | None = None,
                       prefetch_threshold: int | None = None, max_size: float | None = None) -> str:
        """Attach the storage tier (L3) ``backend`` below host memory, in place of any attached now; the
        fields not given keep the start-up flags'. ``InvalidRequest`` naming the field where it cannot be
        (the attached tier, if any, stays). Requests in flight go on; later matches may hit it."""
        lower = self.kv_manager.lower
        if lower is None:
            raise InvalidRequest("hicache_storage_backend", "needs the hierarchical cache, which is off "
                                 "(--enable-hierarchical-cache)")
        given = {"hicache_storage_backend": backend, "hicache_storage_dir": directory,
                 "hicache_storage_prefetch_policy": prefetch_policy,
                 "hicache_storage_prefetch_threshold": prefetch_threshold, "hicache_storage_max_size": max_size}
        given = {k: v for k, v in given.items() if v is not None}
        if given.get("hicache_storage_prefetch_threshold", 1) < 1:
            raise InvalidRequest("hicache_storage_prefetch_threshold", "must be >= 1")
        try:
            config = replace(self.config, **given)
        except ValueError as exc:
            field = next((f for f in given if str(exc).startswith(f)), "hicache_storage_backend")
            raise InvalidRequest(field, str(exc).removeprefix(field).lstrip()) from None
        try:
            tier = attach_storage_tier(self.components.plugins, lower, config)
        except (SelectionError, OSError, RuntimeError) as exc:
            own = [r for c in getattr(exc, "candidates", ()) if c.descriptor.name == backend for r in c.reasons]
            field = "hicache_storage_dir" if any("hicache-storage-dir" in r for r in own) else "hicache_storage_backend"
            raise InvalidRequest(field, f"cannot be used: storage backend {backend!r}: {exc}") from None
        return tier.name

    def detach_storage(self) -> str | None:
        """Detach the storage tier (L3), if any (its name); host memory and the device keep what they hold."""
        lower = self.kv_manager.lower
        tier = lower.detach_storage() if lower is not None else None
        if tier is not None:
            logger.info("hierarchical cache: storage tier %s detached", tier.name)
        return tier.name if tier is not None else None

    def abort_request(self, request_id: str) -> EngineCoreOutput | None:
        """End a request; its last output, or None if it is not here (or on another data-parallel
        rank: its last output comes with a later step)."""
        if self.dp is not None and self.dp.owns(request_id):
            self.dp.abort(request_id)
            return None
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self._awaiting_grammar.pop(request_id, None)
        if self._in_flight is not None:  # its prompt logprobs in flight are read now: an abort is rare
            self._apply_prompt_logprobs(self._in_flight, request_id)
        self.scheduler.abort(request_id)
        for s in req.seqs:
            if not s.is_finished:
                s.status, s.finish_reason = SeqStatus.FINISHED, "abort"
        self._count_finish(req)
        return req.take_output()

    def finish_sequence(self, request_id: str, index: int, stop_reason: str) -> EngineCoreOutput | None:
        """End one completion that the caller saw reach a stop string; the request's output, or None
        if there is no such running completion (or it runs on another data-parallel rank)."""
        if self.dp is not None and self.dp.owns(request_id):
            self.dp.finish(request_id, index, stop_reason)
            return None
        req = self.requests.get(request_id)
        if req is None or not 0 <= index < len(req.seqs) or req.seqs[index].is_finished:
            return None
        self.scheduler.finish(req.seqs[index], "stop", stop_reason)
        if req.finished:
            self._count_finish(req)
            del self.requests[request_id]
        return req.take_output()

    def stats(self) -> EngineStats:
        s, kv = self.scheduler, self.kv_manager.stats()
        compiling = sum(len(self.requests[rid].seqs) for rid in self._awaiting_grammar)  # waiting for their grammar
        spec = self.speculator.counters.snapshot() if self.speculator is not None else None
        out = EngineStats(s.num_running, s.num_waiting + compiling, kv.usage, kv.prefix_queries, kv.prefix_hits,
                          s.stats.num_preemptions, spec, self.kv_manager.hicache_stats())
        if self.dp is not None:  # the other data-parallel ranks' after their last step
            out.add_ranks(self.dp.stats)
        return out

    def reset_counters(self) -> None:
        """Zero every counter the metrics read: requests, tokens, preemptions, prefix-cache hits, drafts;
        under data-parallel attention every rank's."""
        if self.dp is not None:
            self.dp.reset_counters()
        self.counters = EngineCounters()
        self.scheduler.stats = SchedulerStats()
        if self.speculator is not None:
            self.speculator.reset_counters()
        self.kv_manager.reset_stats()

    def reset_prefix_cache(self) -> None:
        """Drop every cached prefix no sequence holds: the target's and its proposer's (this rank's)."""
        self.kv_manager.reset_prefix_cache()
        if self.speculator is not None:
            self.speculator.proposer.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or (self.dp is not None and self.dp.busy())

    def check_alive(self) -> None:
        """Raise ``EngineDeadError`` if a tensor-parallel rank has died (between steps: a step fails itself)."""
        if self.workers is not None:
            self.workers.check()

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks, if any, and the storage tier's writer (its queued writes
        land first, for a bounded time); the engine serves no more steps."""
        lower = self.kv_manager.lower if hasattr(self, "kv_manager") else None
        if lower is not None:
            lower.close()
        if self.workers is not None:
            self.workers.close()

    # -- the step -----------------------------------------------------------------------------

    def step_outputs(self) -> list[EngineCoreOutput]:
        """Run one step; what it changed, per request.

        A call schedules and launches step N+1, then applies the tokens and prompt logprobs of step
        N (stop checks, outputs) while the device computes: whatever the sampling, the inputs of step N+1 that the
        host has not seen yet are read from the token table on the device, and the penalties of its
        rows count their tokens in flight from there. A sequence whose token of step N ends it by
        length is not scheduled in step N+1; one that step N's token stops (or that is aborted, or
        that its reader ends at a stop string) has its token of step N+1 dropped, and its pages went
        back when it ended. Without ``overlap_decode`` a call applies its own step's tokens before
        it returns.

        Under data-parallel attention rank 0's step is every rank's: it starts the others' with the
        requests routed to them, runs its own (a forward with no tokens if it has none) and adds
        their outputs to its own.

        A grammar (structured outputs) masks a row's next draw by the state its last token leads
        to, so a step in flight with constrained rows is applied before the next is launched: those
        steps do not overlap (the rows of other requests in them are sampled as ever)."""
        if self.dp is None:
            return self._step_outputs()
        self.dp.send()
        try:
            outputs = self._step_outputs()
            remote, failures = self.dp.collect()
        except Exception as exc:  # a collective or a pipe failed: because a rank died, if one did
            self.workers.explain(exc)
            raise
        self.failures += failures
        self._count_remote(remote)
        return outputs + remote

    def _step_outputs(self) -> list[EngineCoreOutput]:
        if self._awaiting_grammar:
            self._admit_grammars()
        outputs = []
        flying = self._in_flight
        if flying is not None and flying.tokens is not None and flying.tokens.constrained:
            outputs += self._apply(flying)
            self._in_flight = None
        step = self._launch()
        if self.overlap:
            step, self._in_flight = self._in_flight, step
        if step is not None:
            outputs += self._apply(step)
        if self.kv_manager.lower is not None:  # copies to host memory behind the steps land there
            self.kv_manager.lower.settle(wait=not self.has_unfinished_requests())
        return outputs

    def _launch(self) -> _StepTokens | None:
        """Schedule a step, run its forward and sample it, waiting for nothing on the device."""
        sched = self.scheduler.schedule()
        if not sched:
            if self.idle_steps:  # the other data-parallel ranks' MoE exchanges wait for this rank's
                if self.runner.peers is not None:
                    self.runner.peers.send_idle()
                self.runner.idle()
            return None
        now = time.monotonic()
        step_logits = self.runner.execute(sched)
        if step_logits.features is not None:
            self.speculator.observe(sched.scheduled, step_logits.features)
        seqs: list[Sequence] = []  # those that draw a token, and their logits rows
        rows: list[int] = []
        prompt: list[tuple[Sequence, PromptLogprobs]] = []
        verifying: list[tuple[ScheduledSeq, int]] = []  # decodes with drafts, and their first logits row
        computed, fork_pending, logit_rows = self.scheduler.computed, self.scheduler.fork_pending, step_logits.rows
        for i, s in enumerate(sched.scheduled):
            seq = s.seq
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
            computed(s)
            if s.needs_all_logits and (lps := self._prompt_logprobs(s, step_logits, i)) is not None:
                prompt.append((seq, lps))
            if s.drafts:
                verifying.append((s, logit_rows[i][0]))
            elif s.samples:
                start, count = logit_rows[i]
                row = start + count - 1  # its last row
                seqs.append(seq)
                rows.append(row)
                if fork_pending and seq.index == 0 and seq.request_id in fork_pending:
                    siblings = self.scheduler.fork(seq)
                    seqs += siblings
                    rows += [row] * len(siblings)
        verified = self.speculator.verify(verifying, step_logits.logits) if verifying else None
        return _StepTokens(seqs, self._sample(seqs, rows, step_logits.logits), prompt, verified)

    def _sample(self, seqs: list[Sequence], rows: list[int], logits: torch.Tensor) -> SamplerOutput | None:
        if not seqs:
            return None
        if rows != list(range(logits.shape[0])):  # a decode step samples every row once, in order
            logits = logits.index_select(0, to_device(rows, torch.int64, logits.device))
        out = self.sampler(logits, seqs)
        for s in seqs:
            s.num_pending += 1
        return out

    def _apply(self, done: _StepTokens) -> list[EngineCoreOutput]:
        """Append a step's prompt logprobs, then its tokens, and apply the stop rules; the outputs of
        the requests it changed or finished (prompt logprobs alone change no output: they go with the
        first token)."""
        self._apply_prompt_logprobs(done)
        parts = [(done.seqs, done.tokens)] if done.seqs else []
        if done.verified is not None:  # a decode's kept drafts, then the target's token: each applied in turn
            parts.append(done.verified.resolve(self.scheduler))
        if not parts:
            return []
        now = time.monotonic()
        finish = self.scheduler.finish
        touched: dict[str, None] = {}
        ended: set[str] = set()  # requests with a sequence that ended here: only they can be finished
        for seqs, out in parts:
            tokens = out.token_ids  # waits for the step
            dropped = 0
            for k, seq in enumerate(seqs):
                seq.num_pending -= 1
                if seq.status is SeqStatus.FINISHED:  # stopped or aborted while this step ran (or earlier in
                    dropped += 1  # its run of kept drafts): its token is dropped
                    continue
                token = tokens[k]
                output = seq.output_token_ids
                output.append(token)
                if seq.first_token_time is None:
                    seq.first_token_time = now
                if seq.logprobs is not None:
                    entry = dict(out.top_logprobs[k] or [])
                    entry[token] = out.logprobs[k]
                    seq.logprobs.append(entry)
                # the endings by token (stop strings are the reader's: output_processor.py)
                if seq.grammar is not None and not seq.grammar.accept_token(token):  # it allowed only what it accepts
                    logger.error("request %s: its grammar refused the token %d it allowed; ended",
                                 seq.request_id, token)
                    finish(seq, "abort", None)
                    ended.add(seq.request_id)
                elif token in seq.ending_ids and len(output) >= seq.params.min_tokens:
                    finish(seq, "stop", token if token in seq.params.stop_token_ids else None)
                    ended.add(seq.request_id)
                elif len(output) >= seq.max_output:
                    finish(seq, "length", None)
                    ended.add(seq.request_id)
                touched[seq.request_id] = None
            self.counters.generation_tokens += len(seqs) - dropped
        outputs = []
        for rid in touched:
            req = self.requests[rid]
            if rid in ended and req.finished:
                self._count_finish(req)
                del self.requests[rid]
            if (update := req.take_output()) is not None:
                outputs.append(update)
        return outputs

    @staticmethod
    def _apply_prompt_logprobs(step: _StepTokens, request_id: str | None = None) -> None:
        """Append the prompt logprobs of ``step`` (of ``request_id`` only, if named) not appended yet."""
        rest = []
        for seq, lps in step.prompt:
            if request_id is None or seq.request_id == request_id:
                seq.prompt_logprobs.extend(lps.entries)
            else:
                rest.append((seq, lps))
        step.prompt = rest

    def _prompt_logprobs(self, s: ScheduledSeq, step_logits: StepLogits, i: int) -> PromptLogprobs | None:
        """Logprobs of the prompt tokens this chunk predicts, on their way to the host; None where a
        preemption recomputes only positions already requested (an earlier chunk's may still be in flight)."""
        seq = s.seq
        start, count = step_logits.rows[i]
        prompt = seq.prompt_token_ids
        first = max(s.context_len, seq.prompt_logprobs_requested)  # first position still missing
        last = min(s.context_len + count, len(prompt) - 1)
        if last <= first:
            return None
        seq.prompt_logprobs_requested = last
        rows = step_logits.logits[start + first - s.context_len: start + last - s.context_len]
        return PromptLogprobs(rows, prompt[first + 1: last + 1], seq.params.prompt_logprobs)

    def _count_finish(self, req: Request) -> None:
        for s in req.seqs:
            self.counters.finished[s.finish_reason] = self.counters.finished.get(s.finish_reason, 0) + 1

    def _count_remote(self, outputs: list[EngineCoreOutput]) -> None:
        """Count the tokens and ends of other data-parallel ranks' outputs (their prompts were counted
        as they were routed)."""
        finished = self.counters.finished
        for o in outputs:
            for c in o.completions:
                self.counters.generation_tokens += len(c.token_ids)
                if c.finish_reason is not None:
                    finished[c.finish_reason] = finished.get(c.finish_reason, 0) + 1


class LLMEngine(EngineCore):
    """The core read through an ``OutputProcessor``: prompts may be text, outputs are cumulative
    ``RequestOutput``s with text, and stop strings end completions (in the processor, then here)."""

    def __init__(self, config: EngineConfig, plugins: Plugins | None = None, progress: bool = True) -> None:
        super().__init__(config, plugins, progress)
        self.outputs = OutputProcessor(self.tokenizer)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    stream: bool = True) -> Request:
        """Queue a request. With ``stream`` every step that changes it returns it; else only its end."""
        params = params or SamplingParams()
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.check_grammar(params)
        req = super().add_request(request_id, ids, params)
        self.outputs.add(request_id, prompt if isinstance(prompt, str) else None, ids, params, stream)
        return req

    def abort_request(self, request_id: str) -> RequestOutput | None:
        return self._read(super().abort_request(request_id))

    def finish_sequence(self, request_id: str, index: int, stop_reason: str) -> RequestOutput | None:
        return self._read(super().finish_sequence(request_id, index, stop_reason))

    def step(self) -> list[RequestOutput]:
        """Run one step; the outputs of the requests it changed (of those that do not stream, the end)."""
        results, stops = self.outputs.process(self.step_outputs())
        for request_id, index, stop in stops:  # ended in the processor: the core's word is already read
            EngineCore.finish_sequence(self, request_id, index, stop)
        return results

    def _read(self, out: EngineCoreOutput | None) -> RequestOutput | None:
        results, _ = self.outputs.process([out] if out is not None else [])
        return results[0] if results else None
