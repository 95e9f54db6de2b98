"""The start-up warm-up: which step shapes its plan meets, and that it leaves the engine as it found it."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from engine.core.warmup import plan


def _random_limits(rng: random.Random) -> dict:
    page = rng.choice([1, 4, 16, 64])
    budget = rng.choice([64, 256, 2048, 8192])
    return dict(page_size=page, max_num_batched_tokens=budget, chunk_size=rng.choice([None, 32, 512, 2048]),
                max_model_len=rng.choice([128, 1024, 4096, 32768]), capacity_tokens=page * rng.randrange(64, 4096),
                max_num_seqs=rng.choice([1, 8, 256]))


def test_the_plan_meets_each_class_of_step_within_the_limits(seed):
    rng = random.Random(seed)
    for _ in range(200):
        lim = _random_limits(rng)
        phases = plan(**lim)
        prompts = [(n, p) for ph in phases for n, p in ph.prompts]
        lengths = [n for n, _ in prompts]
        room = lim["max_model_len"] - 4
        assert all(1 <= n <= max(room, 1) for n in lengths), lim
        assert all(len(ph.prompts) <= max(lim["max_num_seqs"], 33) for ph in phases)
        assert 1 in lengths
        if room >= 37 and lim["capacity_tokens"] >= 74:  # an odd length and a multiple of 16 above one
            assert any(n % 16 and n > 16 for n in lengths) and any(n % 16 == 0 for n in lengths), lim
        hit = [ph for ph in phases if ph.repeat_first]
        assert len(hit) == 1 and hit[0].prompts[0][0] >= min(2 * lim["page_size"], room, lim["capacity_tokens"] // 2)
        full = next(ph for ph in phases if ph.name == "full steps")
        step = min(lim["max_num_batched_tokens"], room, lim["capacity_tokens"] // 2)
        if len(full.prompts) < lim["max_num_seqs"]:  # a step's whole budget, and beyond
            assert sum(n for n, _ in full.prompts) >= min(2 * step, lim["capacity_tokens"] // 2), lim
        beside = [ph for ph in phases if ph.joiners]  # decoders finishing one a step, a prefill joining each
        tokens = sorted(p.max_tokens for _, p in beside[0].prompts)
        assert len(beside) == 1 and beside[0].joiners == len(tokens) and tokens == list(range(2, len(tokens) + 2))
        page, most = lim["page_size"], lim["max_num_seqs"]  # each decoder's pages, its tokens at most most + 3
        if lim["capacity_tokens"] >= 2 * most * -(-(most + 3) // page) * page:
            assert len(tokens) == max(lim["max_num_seqs"] - 1, 1), lim
        params = [p for _, p in prompts]
        assert any(p.temperature == 0 for p in params) and any(p.temperature > 0 and p.top_p < 1 for p in params)
        assert any(p.logprobs for p in params) and any(p.prompt_logprobs for p in params)
        assert any(p.repetition_penalty != 1 and p.seed is not None for p in params)


@pytest.fixture(scope="module")
def llms(tiny_qwen3):
    opts = dict(dtype="float32", page_size=4, num_pages=400, chunked_prefill_size=32, max_num_batched_tokens=96,
                max_num_seqs=16, progress=False)
    return LLM(tiny_qwen3, warmup=True, **opts), LLM(tiny_qwen3, warmup=False, **opts)


def test_a_warmed_engine_is_as_a_fresh_one(llms, seed):
    warm, cold = llms
    kv = warm.engine.kv_manager
    stats = kv.stats()
    assert stats.num_free == stats.num_usable and stats.num_cached == 0
    assert stats.prefix_queries == stats.prefix_hits == 0
    assert warm.engine.counters.prompt_tokens == warm.engine.counters.generation_tokens == 0
    assert not warm.engine.counters.finished and warm.engine.scheduler.stats.num_preemptions == 0
    kv.check_consistency()
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 1000) for _ in range(rng.randrange(1, 70))] for _ in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in warm.generate(prompts, params)]
    assert got == [o.outputs[0].token_ids for o in cold.generate(prompts, params)]


def test_the_warm_up_met_a_prefix_hit_and_runs_only_where_asked(llms):
    warm, cold = llms
    report = warm.engine.warmup
    assert report.cached_tokens > 0 and report.steps > report.phases
    assert cold.engine.warmup is None
