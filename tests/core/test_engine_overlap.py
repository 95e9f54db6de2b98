"""Decode steps launched ahead of their inputs' host copy (``overlap_decode``): the same tokens,
finish reasons and text as an engine that reads every step's tokens first, and every page back,
whatever stops, aborts or arrives while a step runs ahead."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams

PAGE_SIZE = 4


def make_llm(model, overlap: bool, **kw) -> LLM:
    opts = dict(dtype="float32", page_size=PAGE_SIZE, num_pages=512, chunked_prefill_size=64,
                enable_prefix_caching=True, max_num_seqs=32, progress=False, overlap_decode=overlap)
    return LLM(str(model), **{**opts, **kw})


@pytest.fixture(scope="module")
def engines(tiny_qwen3):
    return {overlap: make_llm(tiny_qwen3, overlap).engine for overlap in (True, False)}


def random_prompt(engine, text: str, length: int) -> list[int]:
    start = random.randrange(len(text) - 40 * length)
    return engine.tokenizer.encode(text[start: start + 40 * length])[:length]


def random_params(engine) -> SamplingParams:
    """Greedy rows of every kind that ends a sequence, and now and then one that needs the full sampler."""
    kind = random.choice(["plain", "eos", "stop_token", "stop_string", "min_tokens", "penalty"])
    common = dict(temperature=0.0, max_tokens=random.randint(1, 24), ignore_eos=kind != "eos")
    if kind == "stop_token":
        common["stop_token_ids"] = random.sample(range(100, 400), 40)
    elif kind == "stop_string":
        common["stop"] = [random.choice(["e", "(", " ", "in"])]
    elif kind == "min_tokens":
        common.update(min_tokens=random.randint(1, common["max_tokens"]), ignore_eos=False)
    elif kind == "penalty":
        common["repetition_penalty"] = 1.3
    return SamplingParams(**common)


def run_arrivals(engine, arrivals: list[tuple[int, list[int], SamplingParams]]) -> dict:
    """Add request i at step ``arrivals[i][0]`` and step until all finish: what each one ended with."""
    finished, step = {}, 0
    pending = sorted(range(len(arrivals)), key=lambda i: arrivals[i][0])
    while pending or engine.has_unfinished_requests():
        while pending and arrivals[pending[0]][0] <= step:
            i = pending.pop(0)
            engine.add_request(f"r{i}", arrivals[i][1], arrivals[i][2], stream=False)
        for out in engine.step():
            finished[out.request_id] = [(c.token_ids, c.finish_reason, c.stop_reason, c.text) for c in out.outputs]
        step += 1
    return finished


def test_staggered_requests_match_reading_every_step(engines, eval_text, seed):
    """Requests arriving while steps run ahead, ending by length, EOS, stop tokens and strings,
    with min_tokens and a penalty row in between: the same outputs either way, and some steps did run ahead."""
    base = engines[False]
    arrivals = [(random.randint(0, 30), random_prompt(base, eval_text, random.randint(2, 30)), random_params(base))
                for _ in range(14)]
    ran_ahead = []
    engine = engines[True]
    look_ahead = engine._look_ahead
    engine._look_ahead = lambda done: ran_ahead.append(look_ahead(done)) or ran_ahead[-1]
    try:
        got = run_arrivals(engine, arrivals)
    finally:
        del engine._look_ahead
    want = run_arrivals(base, arrivals)
    assert got == want and len(got) == len(arrivals)
    assert any(r is not None for r in ran_ahead)
    for e in engines.values():
        e.kv_manager.check_consistency()


def _step_until_ahead(engine, limit: int = 50) -> None:
    for _ in range(limit):
        engine.step()
        if engine._ahead is not None:
            return
    raise AssertionError("no decode step ran ahead")


@pytest.mark.parametrize("how", ["abort", "finish_sequence"])
def test_ending_requests_while_a_step_runs_ahead_returns_every_page(tiny_qwen3, eval_text, seed, how):
    """Aborts (and the API process's stop strings, ``finish_sequence``) land while a step computes
    past the sequences' ends: its tokens are dropped and every page comes back."""
    engine = make_llm(tiny_qwen3, True, enable_prefix_caching=False).engine
    start = engine.kv_manager.stats().num_free
    ids = [f"r{i}" for i in range(3)]
    for rid in ids:
        engine.add_request(rid, random_prompt(engine, eval_text, random.randint(3, 12)),
                           SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), stream=True)
    _step_until_ahead(engine)
    random.shuffle(ids)
    for rid in ids:
        if how == "abort":
            assert engine.abort_request(rid).finished
        else:
            engine.finish_sequence(rid, 0, "stop-string")
    assert not engine.step()  # the step in flight comes back for nobody
    assert engine._ahead is None and not engine.scheduler.has_work() and not engine.has_unfinished_requests()
    assert engine.kv_manager.stats().num_free == start
    engine.kv_manager.check_consistency()


def test_page_shortage_falls_back_to_ordinary_steps(tiny_qwen3, eval_text, seed):
    """Too few pages for every sequence's next token: no step runs ahead of a preemption, and the
    outputs are those of an engine with pages to spare."""
    tight = make_llm(tiny_qwen3, True, num_pages=36, max_num_seqs=6, enable_prefix_caching=False)
    roomy = make_llm(tiny_qwen3, False, enable_prefix_caching=False)
    prompts = [random_prompt(roomy.engine, eval_text, random.randint(8, 16)) for _ in range(6)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params)]
    want = [o.outputs[0].token_ids for o in roomy.generate(prompts, params)]
    assert got == want
    assert tight.engine.scheduler.stats.num_preemptions > 0
    assert tight.engine.kv_manager.stats().num_used == 0
    tight.engine.kv_manager.check_consistency()


def test_context_limit_is_not_run_past(tiny_qwen3, eval_text, seed):
    """A sequence that fills its context ends by length there: no step runs ahead past it."""
    llm = make_llm(tiny_qwen3, True, max_model_len=40)
    prompt = random_prompt(llm.engine, eval_text, 30)
    (out,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))
    assert out.outputs[0].finish_reason == "length" and len(prompt) + len(out.outputs[0].token_ids) == 41

