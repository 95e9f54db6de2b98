"""Overlapped decode (``overlap_decode``): each step is launched before the host has read the tokens
of the step before it, reading the inputs it lacks from the token table on the device, whatever the
sampling. The same outputs as an engine that reads every step's tokens first (seeds, temperature,
top-k/top-p/min-p, penalties, logit_bias, logprobs, n > 1, every kind of stop), and every page and
table slot back, whatever stops, aborts or arrives while a step is in flight."""

from __future__ import annotations

import math
import random

import pytest

from engine import LLM, SamplingParams

PAGE_SIZE = 4
EOS = 1  # both tiny models'


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


def random_params(max_tokens: int = 24) -> SamplingParams:
    """Any sampling (seeded where it draws), ending by any rule; n > 1 now and then."""
    p = dict(temperature=random.choice([0.0, 0.0, 0.7, 1.2]), seed=random.randrange(2**31),
             top_k=random.choice([0, 0, 5, 40]), top_p=random.choice([1.0, 0.8]), min_p=random.choice([0.0, 0.05]),
             repetition_penalty=random.choice([1.0, 1.0, 1.3, 0.5]),
             presence_penalty=random.choice([0.0, 0.0, 0.8, -2.0]), frequency_penalty=random.choice([0.0, 0.0, 0.5, 2.0]),
             logprobs=random.choice([None, None, 0, 3]),
             n=random.choice([1, 1, 1, 2, 3]), max_tokens=random.randint(1, max_tokens), ignore_eos=True)
    kind = random.choice(["length", "eos", "stop_token", "stop_string", "bias"])
    if kind == "eos":  # EOS made likely, held back by min_tokens for a while
        p.update(logit_bias={EOS: random.uniform(4, 12)}, ignore_eos=False,
                 min_tokens=random.randint(0, p["max_tokens"]))
    elif kind == "stop_token":
        p.update(stop_token_ids=random.sample(range(100, 400), 40), min_tokens=random.randint(0, 3))
        p["min_tokens"] = min(p["min_tokens"], p["max_tokens"])
    elif kind == "stop_string":
        p["stop"] = [random.choice(["e", "(", " ", "in", "\n"])]
    elif kind == "bias":
        p["logit_bias"] = {random.randrange(100, 2000): random.uniform(-5, 5) for _ in range(4)}
    return SamplingParams(**p)


def outcome(out) -> list[tuple]:
    """What a finished request ended with, logprobs last."""
    return [(c.token_ids, c.finish_reason, c.stop_reason, c.text, c.logprobs) for c in out.outputs]


def assert_same(got: dict, want: dict) -> None:
    """The same outcomes; logprobs to 1e-4 (raw model logprobs: the rows around a sequence change
    the last bits of its logits, never its tokens)."""
    assert got.keys() == want.keys()
    for rid in want:
        assert [c[:4] for c in got[rid]] == [c[:4] for c in want[rid]], rid
        for a, b in zip(got[rid], want[rid]):
            assert (a[4] is None) == (b[4] is None), rid
            for x, y in zip(a[4] or [], b[4] or [], strict=True):
                assert x.keys() == y.keys() and all(math.isclose(x[t], y[t], abs_tol=1e-4) for t in x), rid


def run_arrivals(engine, arrivals: list[tuple], abort_at: dict[int, int]) -> dict:
    """Add request i at step ``arrivals[i][0]``, abort request i once its first completion has
    ``abort_at[i]`` tokens, and step until all end: what each one ended with."""
    finished, step = {}, 0
    pending = sorted(range(len(arrivals)), key=lambda i: arrivals[i][0])
    while pending or engine.has_unfinished_requests():
        while pending and arrivals[pending[0]][0] <= step:
            i = pending.pop(0)
            engine.add_request(f"r{i}", arrivals[i][1], arrivals[i][2], stream=False)
        for out in engine.step():
            finished[out.request_id] = outcome(out)
        for i, k in abort_at.items():
            req = engine.requests.get(f"r{i}")
            if req is not None and len(req.seqs[0].output_token_ids) >= k:
                finished[f"r{i}"] = outcome(engine.abort_request(f"r{i}"))
        step += 1
    return finished


def assert_all_returned(engine) -> None:
    """No page held by anyone but the prefix cache, no slot held, the KV state consistent."""
    engine.kv_manager.check_consistency()
    stats = engine.kv_manager.stats()
    assert stats.num_used == stats.num_cached and stats.usage == 0
    assert not engine.scheduler.has_work() and not engine.requests
    assert engine.token_table.num_free == engine.token_table.num_slots


class Spy:
    """Records the arguments and results of ``owner.name`` while installed (an instance attribute)."""

    def __init__(self, owner, name: str) -> None:
        self.owner, self.name, self.fn = owner, name, getattr(owner, name)
        self.calls: list[tuple] = []
        self.results: list = []

    def __enter__(self) -> "Spy":
        def spied(*args):
            self.calls.append(args)
            self.results.append(self.fn(*args))
            return self.results[-1]
        setattr(self.owner, self.name, spied)
        return self

    def __exit__(self, *exc) -> None:
        delattr(self.owner, self.name)


def test_every_sampling_option_matches_reading_every_step(engines, eval_text, seed):
    """Staggered arrivals with every sampling option and every ending, some aborted mid-run: the
    same tokens, texts, logprobs and finish reasons either way; steps did read their inputs and
    penalties did read tokens in flight from the table; everything came back."""
    base = engines[False]
    arrivals = [(random.randint(0, 30), random_prompt(base, eval_text, random.randint(2, 30)), random_params())
                for _ in range(16)]
    abort_at = {i: random.randint(1, 12) for i in random.sample(range(len(arrivals)), 4)}
    engine = engines[True]
    with Spy(engine.token_table, "fill") as fills, Spy(engine.sampler, "_in_flight") as penalties:
        got = run_arrivals(engine, arrivals, abort_at)
    want = run_arrivals(base, arrivals, abort_at)
    assert_same(got, want)
    assert len(got) == len(arrivals) and fills.calls and any(r is not None for r in penalties.results)
    for e in engines.values():
        e.step()  # the step in flight, if any, comes back for nobody
        assert_all_returned(e)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_penalties_count_the_token_in_flight(engines, eval_text, seed, temperature):
    """Penalties that favour what was said: each decode step's penalties read, from the table, the
    token drawn by the step before (not on the host yet), and the draws equal reading every step."""
    prompt = random_prompt(engines[False], eval_text, random.randint(3, 20))
    params = SamplingParams(temperature=temperature, seed=seed, max_tokens=12, ignore_eos=True, n=random.choice([1, 2]),
                            repetition_penalty=0.5, presence_penalty=-2.0, frequency_penalty=-2.0)
    with Spy(engines[True].sampler, "_in_flight") as reads:
        got = run_arrivals(engines[True], [(0, prompt, params)], {})
    assert_same(got, run_arrivals(engines[False], [(0, prompt, params)], {}))
    tokens = [c[0] for c in got["r0"]]
    want = [[t[k] for t in tokens] for k in range(len(tokens[0]) - 1)]
    read = [flight[1].tolist() for flight in reads.results if flight is not None]  # None: the prefill step
    assert read[::2] == read[1::2] == want  # repetition, then presence and frequency: one read each


def test_decode_inputs_come_from_the_table(engines, eval_text, seed):
    """Once decoding, every step reads each sequence's input token from the table: the host has not
    seen it when the step is launched."""
    engine = engines[True]
    params = random_params()
    params.max_tokens, params.stop, params.stop_token_ids, params.ignore_eos = 16, [], [], True
    engine.add_request("solo", random_prompt(engine, eval_text, random.randint(3, 20)), params, stream=True)
    with Spy(engine.token_table, "fill") as fills:
        while engine.has_unfinished_requests():
            engine.step()
    assert [len(rows) for _, rows, _ in fills.calls] == [params.n] * 15  # the inputs of tokens 2 to 16
    engine.step()
    assert_all_returned(engine)


@pytest.mark.parametrize("how", ["abort", "finish_sequence"])
def test_ending_requests_while_a_step_is_in_flight_returns_every_page(tiny_qwen3, eval_text, seed, how):
    """Aborts (and the API process's stop strings, ``finish_sequence``) land while a step computes
    past the sequences' ends: its tokens are dropped and every page and slot comes back."""
    engine = make_llm(tiny_qwen3, True, enable_prefix_caching=False).engine
    start = engine.kv_manager.stats().num_free
    ids = [f"r{i}" for i in range(3)]
    for rid in ids:
        params = random_params()
        params.max_tokens, params.stop, params.stop_token_ids, params.ignore_eos = 40, [], [], True
        engine.add_request(rid, random_prompt(engine, eval_text, random.randint(3, 12)), params, stream=True)
    for _ in range(random.randint(3, 8)):
        engine.step()
    assert engine._in_flight is not None and all(s.num_pending == 1 for r in ids for s in engine.requests[r].seqs)
    seqs = [s for r in ids for s in engine.requests[r].seqs]
    random.shuffle(ids)
    for rid in ids:
        if how == "abort":
            assert engine.abort_request(rid).finished
        else:
            for s in engine.requests[rid].seqs:
                engine.finish_sequence(rid, s.index, "stop-string")
    assert not engine.step()  # the step in flight comes back for nobody
    assert engine._in_flight is None and not engine.has_unfinished_requests()
    assert all(s.slot == 0 and s.num_pending == 0 for s in seqs)
    assert engine.kv_manager.stats().num_free == start
    assert_all_returned(engine)


def test_page_shortage_keeps_outputs(tiny_qwen3, eval_text, seed):
    """Too few pages for every sequence's next token: sequences are preempted (some with a token in
    flight) and recomputed, and the outputs are those of an engine with pages to spare."""
    tight = make_llm(tiny_qwen3, True, num_pages=36, max_num_seqs=6, enable_prefix_caching=False)
    roomy = make_llm(tiny_qwen3, False, enable_prefix_caching=False)
    prompts = [random_prompt(roomy.engine, eval_text, random.randint(8, 16)) for _ in range(6)]
    params = [SamplingParams(temperature=random.choice([0.0, 0.8]), seed=random.randrange(2**31), top_p=0.9,
                             presence_penalty=random.choice([0.0, 0.5]), repetition_penalty=random.choice([1.0, 1.2]),
                             n=random.choice([1, 1, 3]), max_tokens=20, ignore_eos=True) for _ in prompts]
    got = [[c.token_ids for c in o.outputs] for o in tight.generate(prompts, params)]
    want = [[c.token_ids for c in o.outputs] for o in roomy.generate(prompts, params)]
    assert got == want
    assert tight.engine.scheduler.stats.num_preemptions > 0
    tight.engine.step()
    assert_all_returned(tight.engine)


def test_a_sibling_left_waiting_for_pages_keeps_its_first_token(tiny_qwen3, engines, eval_text, seed):
    """An n > 1 sibling that finds no page at the fork waits with its first token still in flight;
    pages freed at once (an abort) do not let it in before that token reaches the host, and it
    recomputes to the same completion as an engine with pages to spare."""
    tight = make_llm(tiny_qwen3, True, num_pages=12, enable_prefix_caching=False).engine
    hog = random_prompt(tight, eval_text, 30)  # 8 of the 11 usable pages
    prompt = random_prompt(tight, eval_text, 9)  # 3 pages, the last partial: each sibling needs a copy
    params = SamplingParams(temperature=0.8, seed=seed, n=3, max_tokens=8, ignore_eos=True, presence_penalty=0.5)
    tight.add_request("hog", hog, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    tight.add_request("b", prompt, params)
    for _ in range(3):
        tight.step()
        waiting = [s for s in tight.requests["b"].seqs if s.status.value == "waiting" and s.num_pending]
        if waiting:
            break
    assert waiting, "no sibling was left waiting at the fork"
    tight.abort_request("hog")
    got = run_arrivals(tight, [], {})
    want = run_arrivals(engines[False], [(0, prompt, params)], {})
    assert_same({"b": got["b"]}, {"b": want["r0"]})
    tight.step()
    assert_all_returned(tight)


def test_context_limit_is_not_run_past(tiny_qwen3, eval_text, seed):
    """A sequence whose token in flight fills its context is not scheduled again: it ends by length there."""
    llm = make_llm(tiny_qwen3, True, max_model_len=40)
    prompt = random_prompt(llm.engine, eval_text, 30)
    (out,) = llm.generate([prompt], SamplingParams(temperature=0.9, seed=seed, max_tokens=None, ignore_eos=True,
                                                   n=2))
    for c in out.outputs:
        assert c.finish_reason == "length" and len(prompt) + len(c.token_ids) == 41


@pytest.fixture(scope="module")
def dsv4_engines(shared_dir):
    model = shared_dir / "models" / "tiny-dsv4-py"
    return {overlap: make_llm(model, overlap, max_model_len=256, num_pages=256, max_num_seqs=8).engine
            for overlap in (True, False)}


def test_windowed_model_matches_reading_every_step(dsv4_engines, eval_text, seed):
    """DeepSeek-V4 (window pages, compressor state): steps computed past a stop or an abort leave its
    windows and pages as they should be, and the outputs match."""
    base = dsv4_engines[False]
    arrivals = [(random.randint(0, 2), random_prompt(base, eval_text, random.randint(4, 16)), random_params(8))
                for _ in range(3)]
    got, want = (run_arrivals(dsv4_engines[overlap], arrivals, {0: 3}) for overlap in (True, False))
    assert_same(got, want)
    for e in dsv4_engines.values():
        e.step()
        assert_all_returned(e)


def test_prompt_logprobs_match_reading_every_step(tiny_qwen3, eval_text, seed):
    """Prompt logprobs come to the host behind their step. Over chunked prefills, preemptions that
    recompute prompts, aborts and requests that end in the step of their last prompt chunk: the
    same outputs and the same prompt logprobs (each position once) as reading every step first."""
    engines = {overlap: make_llm(tiny_qwen3, overlap, num_pages=24, max_num_seqs=6, chunked_prefill_size=8,
                                 enable_prefix_caching=False).engine for overlap in (True, False)}
    arrivals = []
    for _ in range(8):
        params = random_params(max_tokens=random.choice([1, 1, 24]))
        params.prompt_logprobs = random.choice([0, 2])
        arrivals.append((random.randint(0, 2), random_prompt(engines[False], eval_text, random.randint(9, 40)), params))
    abort_at = {i: random.randint(1, 6) for i in random.sample(range(len(arrivals)), 2)}
    for _ in range(2):  # the latest arrivals, more than the pages hold: preempted and recomputed
        params = SamplingParams(temperature=0.8, seed=random.randrange(2**31), max_tokens=40, ignore_eos=True,
                                prompt_logprobs=1)
        arrivals.append((3, random_prompt(engines[False], eval_text, random.randint(36, 40)), params))
    got, want = ({}, {}), ({}, {})
    for engine, (outcomes, prompts) in zip((engines[False], engines[True]), (want, got)):
        with Spy(engine.outputs, "process") as processed, Spy(engine.scheduler, "_preempt") as preempted:
            outcomes.update(run_arrivals(engine, arrivals, abort_at))
        prompts.update((o.request_id, o.prompt_logprobs) for results, _ in processed.results for o in results
                       if o.finished)
    assert_same(got[0], want[0])
    assert got[1].keys() == want[1].keys() == {f"r{i}" for i in range(len(arrivals))}
    for rid, lps in want[1].items():
        prompt = arrivals[int(rid[1:])][1]
        assert len(lps) == len(got[1][rid]) == len(prompt) and lps[0] is None is got[1][rid][0], rid
        for x, y, t in zip(got[1][rid][1:], lps[1:], prompt[1:]):
            assert t in x and x.keys() == y.keys() and all(math.isclose(x[k], y[k], abs_tol=1e-4) for k in x), rid
    assert any(seq.wants_prompt_logprobs for seq, in preempted.calls)  # in the overlapped engine
    engines[True].step()
    assert_all_returned(engines[True])


@pytest.mark.parametrize("steps", [1, 2])
def test_abort_mid_prompt_keeps_the_prompt_logprobs_in_flight(tiny_qwen3, eval_text, seed, steps):
    """An abort while a prompt chunk's logprobs are in flight: its output carries them, as when every
    step is read first."""
    outs, prompt = {}, None
    for overlap in (True, False):
        engine = make_llm(tiny_qwen3, overlap, chunked_prefill_size=8).engine
        prompt = prompt or random_prompt(engine, eval_text, 30)
        engine.add_request("r", prompt, SamplingParams(max_tokens=4, prompt_logprobs=1))
        for _ in range(steps):
            assert not engine.step()
        outs[overlap] = engine.abort_request("r").prompt_logprobs
    assert len(outs[True]) == len(outs[False]) == 1 + 8 * steps
    assert [list(d) if d else d for d in outs[True]] == [list(d) if d else d for d in outs[False]]
