"""Start-up warm-up: run the step shapes a server meets before it serves, so that no request waits
for a kernel to compile.

A Triton kernel compiles once per specialization: its constexprs (launch configs picked by token
count bands), and each integer argument's class (equal to 1, a multiple of 16, neither). The
first request of a new shape would otherwise pay that compile in its time to first token (seconds
on a GPU, for every such shape). The warm-up drives the engine's own step loop over synthetic
requests chosen to meet each class: single-token and odd-length prompts, a page-aligned prompt
sent again (a prefix hit, the prefill with a cached context), full chunked-prefill steps,
decodes at several batch sizes, steps that prefill one prompt beside every number of decoding
sequences (the decode kernels' constexprs follow that number, and such a step runs eagerly), and
each sampling path (greedy, temperature with top-k/top-p/min-p, penalties, seeds, logprobs and
prompt logprobs). The sampling backend then compiles each of its launch classes directly: its
kernels specialize on the number of sampled rows and on which filters any row uses, too many
combinations for requests to meet. Decode graphs were captured before this; their shapes are
warm already. Triton keeps what it compiles on disk (``TRITON_CACHE_DIR``,
~/.triton/cache by default), so a restart on the same machine loads instead of compiling.

Afterwards the engine is as it was: the warm-up's prefixes leave the cache (a proposer's own
too), its counters are zeroed, and every page is free.

Under data-parallel attention (core/distributed/dp_attention.py) rank 0's steps are every rank's,
and the MoE layers' exchanges inside each forward need every rank: rank 0 runs the warm-up, and
sends every warm-up request to every rank (each rank's copy its own), so each rank meets every
shape in the same steps; a rank done before the others runs idle forwards, as it would serving.
Each rank's sampling backend compiles its launch classes as that rank starts (``warm_up_sampling``),
and the other ranks' prefix caches and counters are reset with one last step of no requests.
"""

from __future__ import annotations

import logging
import contextlib
import random
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tqdm import tqdm

from .sampling_params import SamplingParams

if TYPE_CHECKING:
    from .engine import EngineCore

logger = logging.getLogger(__name__)

_SAMPLED = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, max_tokens=3, ignore_eos=True)
_PENALISED = SamplingParams(temperature=1.0, repetition_penalty=1.1, presence_penalty=0.2, frequency_penalty=0.2,
                            seed=1, logprobs=2, max_tokens=3, ignore_eos=True)
_GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


@dataclass
class Phase:
    """Requests admitted together and run to completion: their prompt lengths and parameters."""

    name: str
    prompts: list[tuple[int, SamplingParams]] = field(default_factory=list)
    repeat_first: bool = False  # send the first prompt again once the phase ends: a prefix hit
    joiners: int = 0  # one-token prompts sent one a step while the others decode: prefill beside decodes


def plan(page_size: int, max_num_batched_tokens: int, chunk_size: int | None, max_model_len: int,
         capacity_tokens: int, max_num_seqs: int) -> list[Phase]:
    """The phases, their prompts within the context, the KV pages and the number of sequences."""
    room = max(min(max_model_len - _GREEDY.max_tokens - 1, capacity_tokens // 2), 1)
    fit = lambda n: max(min(n, room), 1)  # noqa: E731 - a clamp read in each line below
    aligned = fit(max(2 * page_size, 16))  # whole pages, a multiple of 16 where the page allows
    phases = [
        Phase("one token", [(1, _GREEDY)]),
        Phase("odd prompt, sampled", [(fit(37), _SAMPLED)]),
        Phase("prefix hit", [(aligned, _GREEDY)], repeat_first=True),
        Phase("penalties, seeds, logprobs", [(fit(16), _PENALISED),
                                             (fit(23), SamplingParams(max_tokens=2, prompt_logprobs=1))]),
    ]
    step = min(max_num_batched_tokens, room)
    chunk = min(chunk_size or step, step)
    full = Phase("full steps")  # a budget's worth of prompts, each split into chunks where chunking is on
    left = min(2 * step, capacity_tokens // 2)
    while left > 0 and len(full.prompts) < max_num_seqs:
        n = fit(min(chunk + 3, left))
        full.prompts.append((n, _GREEDY if len(full.prompts) % 2 else _SAMPLED))
        left -= n
    phases.append(full)
    batch = Phase("decode batch", [(fit(5 + 3 * i), _GREEDY) for i in range(min(max_num_seqs, 33))])
    phases.append(batch)
    # request i decodes i + 2 tokens, so after their prefill each step has one decoder fewer, and a
    # joiner prefills beside them: every count of decoders from max_num_seqs - 1 down to 1
    decoders = max(max_num_seqs - 1, 1)
    while decoders > 1 and decoders * -(-(decoders + 4) // page_size) * page_size > capacity_tokens // 2:
        decoders -= 1
    phases.append(Phase("prefill beside decodes", [(1, SamplingParams(temperature=0.0, max_tokens=i + 2,
                                                                       ignore_eos=True)) for i in range(decoders)],
                        joiners=decoders))
    return phases


@dataclass
class WarmupReport:
    phases: int
    steps: int
    cached_tokens: int  # prompt tokens the repeated prompts found in the prefix cache
    seconds: float


def warm_up(core: EngineCore, progress: bool = True) -> WarmupReport:
    """Run every phase of ``plan`` through ``core``'s step loop, then leave no trace of it. It runs
    as the core's construction ends, before a subclass has set up its readers: requests go in
    through the core's own ``add_request``."""

    add = _sender(core)
    cfg, kv = core.config, core.kv_manager
    free = kv.stats().num_free
    phases = plan(cfg.page_size, cfg.max_num_batched_tokens, cfg.chunked_prefill_size, core.max_model_len,
                  free * cfg.page_size, cfg.max_num_seqs)
    rng = random.Random(0)
    start, steps, cached = time.perf_counter(), 0, 0
    # made-up prompts: their KV stays out of a storage tier other engines share
    with kv.lower.storage_paused() if kv.lower is not None else contextlib.nullcontext():
        for phase in tqdm(phases, desc="warm-up (compiling kernels)", disable=not progress):
            prompts = [[rng.randrange(core.vocab_size) for _ in range(n)] for n, _ in phase.prompts]
            for i, (ids, (_, params)) in enumerate(zip(prompts, phase.prompts)):
                add(f"warmup-{phase.name}-{i}", ids, params)
            joiners = [(f"warmup-{phase.name}-join-{j}", [rng.randrange(core.vocab_size) for _ in range(2)])
                       for j in range(phase.joiners)]  # two tokens: a one-token step is a decode's shape
            steps += _drain(core, joiners)[0]
            if phase.repeat_first:
                add(f"warmup-{phase.name}-again", prompts[0], phase.prompts[0][1])
                n, hit = _drain(core)
                steps, cached = steps + n, cached + hit
        warm_up_sampling(core)
    core.reset_prefix_cache()
    core.reset_counters()
    if core.dp is not None:  # the other ranks' resets go with a step
        core.dp.reset_prefix_caches()
        core.step_outputs()
    report = WarmupReport(len(phases), steps, cached, time.perf_counter() - start)
    logger.info("warm-up: %d steps of %d phases in %.1f s (--skip-warmup skips it)", steps, len(phases),
                report.seconds)
    return report


def warm_up_sampling(core: EngineCore) -> None:
    """Compile each of the sampling backend's launch classes (no request meets them all)."""
    core.sampler.backend.warm_up(core.sampler.vocab_size, core.config.max_num_seqs, core.sampler.device)


def _sender(core: EngineCore):
    """How a warm-up request goes in: through the core's own ``add_request``, under data-parallel
    attention to every rank (a copy for rank r is named with ``@r``)."""
    from .engine import EngineCore

    if core.dp is None:
        return EngineCore.add_request.__get__(core)

    def everywhere(request_id: str, ids: list[int], params: SamplingParams) -> None:
        for rank in range(core.dp.ranks):
            EngineCore.add_request(core, f"{request_id}@{rank}" if rank else request_id, ids, params, rank)
    return everywhere


_JOINER = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def _drain(core: EngineCore, joiners: list[tuple[str, list[int]]] = ()) -> tuple[int, int]:
    """Step until every request has finished -> (steps, prompt tokens served from the prefix cache);
    ``joiners`` (request id, prompt) are sent one before each step after the first."""
    steps = cached = 0
    add = _sender(core)
    while core.has_unfinished_requests():
        if steps and steps <= len(joiners):
            add(*joiners[steps - 1], _JOINER)
        cached += sum(out.num_cached_tokens for out in core.step_outputs() if out.finished)
        steps += 1
    return steps, cached
