"""Speculative decoding under data-parallel attention: tiny-dsv4-py on 2 processes over gloo, the
experts partitioned over both (all_to_all), each rank drafting for its own requests and verifying
them (n-gram lookup; the next-n layer trained for it, tests/assets/tiny-dsv4-py-mtp, whose MoE
spans both ranks; a draft model), gives the greedy tokens of one process without speculation, and
drafts as many tokens, and keeps as many, as one speculating process does:
through chunked prefill, drafts kept and drafts rejected on both ranks, and a prompt sent again to
the rank that caches it (a prefix hit), drafted for there while the other rank idles; every KV
page back on both ranks. And the start-up warm-up under data-parallel attention: every rank runs every
phase on copies of rank 0's requests, and both ranks' caches and counters are empty after it."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import pytest

from engine import LLM, SamplingParams
from engine.core.config import EngineConfig, ModelConfig
from engine.core.distributed.dp_attention import DataParallelRanks
from engine.core.engine import EngineCore

from tp_helpers import DSV4_OPTS, TIMEOUT_S, within

ASSETS = Path(__file__).parents[2] / "assets"
OPTS = {k: v for k, v in DSV4_OPTS.items() if k != "num_pages"}
K = 3
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def spec_config(dsv4: Path, method: str) -> dict:
    spec = {"method": method, "num_speculative_tokens": K}
    spec.update({"ngram": {"prompt_lookup_min": 1, "prompt_lookup_max": 3},
                 "mtp": {"model": str(ASSETS / "tiny-dsv4-py-mtp")},
                 "dspark": {"model": str(ASSETS / "tiny-dsv4-py-dspark")},
                 "draft_model": {"model": str(dsv4.parent / "tiny-qwen3-py")}}[method])
    return spec


def speculating(dsv4: Path, method: str, **kw) -> LLM:
    return within(TIMEOUT_S, lambda: LLM(dsv4, num_pages=128, tensor_parallel_size=2, data_parallel_size=2,
                                         enable_dp_attention=True, expert_parallel=True,
                                         speculative_config=spec_config(dsv4, method), distributed_timeout=TIMEOUT_S,
                                         **{**OPTS, **kw}))


def repetitive(llm: LLM, text: str, rng: random.Random) -> list[int]:
    """A passage (past the 32-token chunk: prefilled in two steps), then the passage again cut short: a
    model that copies continues it, so drafts are kept, and where it stops copying, rejected."""
    start = rng.randrange(len(text) - 2000)
    passage = llm.tokenizer.encode(text[start:start + 2000])[:rng.randint(24, 36)]
    return passage + passage[:rng.randint(9, len(passage) // 2)]


def tokens(llm: LLM, batch: list[list[int]], params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in within(TIMEOUT_S, lambda: llm.generate(batch, params))]


@pytest.mark.parametrize("method", ["ngram", "mtp", "draft_model", "dspark"])
def test_greedy_tokens_of_one_process(method, single, dsv4, eval_text, run_seed):
    llm = speculating(dsv4, method)
    try:
        rng = random.Random(run_seed)
        batch = [repetitive(single, eval_text, rng) for _ in range(6)]  # placed alternately: 0, 2, 4 on rank 0
        # outputs of several lengths: near its end a request drafts fewer tokens, so the ranks' drafting differs
        params = [SamplingParams(temperature=0, max_tokens=rng.randint(6, 16), ignore_eos=True) for _ in batch]
        want = tokens(single, batch, params)
        assert tokens(llm, batch, params) == want
        engine = llm.engine
        own, both = engine.speculator.counters, engine.stats().spec
        assert 0 < own.num_draft_tokens < both.num_draft_tokens, "both ranks drafted"
        # the drafts of one speculating process, kept as often (MTP: its next-n layer's experts partitioned too)
        one = LLM(dsv4, speculative_config=spec_config(dsv4, method), **DSV4_OPTS)
        assert tokens(one, batch, params) == want
        if method == "dspark":  # verify lengths chosen by each rank's own timed curve, as one process does
            assert engine.speculator.verify_length.curve.tokens == one.engine.speculator.verify_length.curve.tokens
        else:
            assert one.engine.stats().spec == both
        if method != "draft_model":  # the draft model (another model) keeps few of its drafts
            assert 0 < both.num_accepted_tokens < both.num_draft_tokens, "drafts both kept and rejected"
        # prompt 1 again: rank 1 caches it (its proposer's cache too) and speculates alone, rank 0 idles
        drafted, hits = own.num_draft_tokens, engine.kv_manager.stats().prefix_hits
        assert tokens(llm, batch[1:2], params[1]) == want[1:2]
        s = engine.stats()
        assert engine.speculator.counters.num_draft_tokens == drafted  # rank 0 drafted nothing
        assert s.spec.num_draft_tokens > both.num_draft_tokens
        assert s.prefix_cache_hits > engine.kv_manager.stats().prefix_hits == hits
        # every page back on both ranks (rank 0's and its proposer's checked whole)
        assert s.num_running == s.num_waiting == 0 and s.kv_usage == 0 and not engine.has_unfinished_requests()
        engine.kv_manager.check_consistency()
        proposer = engine.speculator.proposer
        if method == "dspark":
            assert not proposer._contexts
        elif method != "ngram":
            assert not proposer._seqs and proposer.kv.stats().usage == 0
    finally:
        llm.engine.shutdown()


def test_warm_up_runs_every_phase_on_every_rank(dsv4, monkeypatch):
    sent, finished = {}, []  # rank 0's warm-up requests (id -> prompt); those rank 1 finished
    add, collect = EngineCore.add_request, DataParallelRanks.collect

    def spied_add(self, request_id, ids, params, rank=None):
        if rank == 0:
            sent[request_id] = ids
        return add(self, request_id, ids, params, rank)

    def spied_collect(self):
        outputs, failures = collect(self)
        finished.extend(o.request_id for o in outputs if o.finished)
        return outputs, failures

    monkeypatch.setattr(EngineCore, "add_request", spied_add)
    monkeypatch.setattr(DataParallelRanks, "collect", spied_collect)
    llm = speculating(dsv4, "ngram", warmup=True)
    monkeypatch.undo()
    engine = llm.engine
    try:
        report = engine.warmup
        assert len(sent) > 30 and sorted(finished) == sorted(f"{rid}@1" for rid in sent)  # rank 1 ran each copy
        assert report.cached_tokens > 0 and report.cached_tokens % 2 == 0  # each rank's repeated prompt hit
        # nothing left of it: counters, pages and both ranks' prefix caches
        s = engine.stats()
        assert (s.prefix_cache_queries, s.num_running, s.kv_usage, s.spec.num_draft_tokens) == (0, 0, 0.0, 0)
        kv = engine.kv_manager.stats()
        assert kv.num_free == kv.num_usable
        again = sent["warmup-prefix hit-again"]  # the prompt each rank's cache held during the warm-up
        for rank in (0, 1):
            EngineCore.add_request(engine, f"after-{rank}", again, GREEDY, rank)
        while engine.has_unfinished_requests():
            within(TIMEOUT_S, engine.step_outputs)
        s = engine.stats()
        assert s.prefix_cache_queries == 2 * (len(again) - 1) and s.prefix_cache_hits == 0
    finally:
        engine.shutdown()


def refusals(check, model_dir: Path, spec: dict) -> Callable[[int, int], list[str]]:
    """The reasons ``check`` gives for ``spec`` on ``model_dir`` at ``tp`` processes, ``dp`` of them
    data-parallel ranks (data-parallel attention where there are several)."""
    model = ModelConfig.from_dir(model_dir, "float32", "cpu")

    def reasons(tp: int, dp: int) -> list[str]:
        config = EngineConfig(model=str(model_dir), tensor_parallel_size=tp, data_parallel_size=dp,
                              enable_dp_attention=dp > 1, speculative_config=spec)
        return check(SimpleNamespace(engine_config=config, model_config=model))
    return reasons

