"""Speculative decoding with the n-gram proposer end to end: greedy output identical to decoding
without it on tiny-qwen3-py and tiny-dsv4-py, over chunked prefill, prefix hits, preemption and
aborts, with repetitive prompts whose drafts are kept; stops of every kind inside a kept run end
where they would without drafts; logprobs equal; seeded sampling repeats whatever the batch; and
every page comes back with nothing but real tokens in the prefix cache."""

from __future__ import annotations

import math
import random

import pytest

from engine import LLM, SamplingParams

PAGE = 4
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
MODELS = ["tiny-qwen3-py", "tiny-dsv4-py"]


def make(path, spec: bool, **kw) -> LLM:
    opts = dict(dtype="float32", page_size=PAGE, num_pages=400, chunked_prefill_size=16, max_num_seqs=8,
                progress=False, speculative_config=NGRAM if spec else None)
    return LLM(str(path), **{**opts, **kw})


@pytest.fixture(scope="module", params=MODELS)
def pair(request, shared_dir):
    """(without speculation and without a prefix cache: the reference; with n-gram speculation)"""
    path = shared_dir / "models" / request.param
    return make(path, False, enable_prefix_caching=False), make(path, True)


@pytest.fixture(scope="module")
def qwen_pair(shared_dir):
    path = shared_dir / "models" / "tiny-qwen3-py"
    return make(path, False, enable_prefix_caching=False), make(path, True)


def text_ids(llm: LLM, text: str, n: int) -> list[int]:
    start = random.randrange(len(text) - 40 * n)
    return llm.tokenizer.encode(text[start:start + 40 * n])[:n]


def repetitive(llm: LLM, text: str) -> list[int]:
    """A passage, then the passage again cut short: a model that copies continues it, so drafts are kept."""
    passage = text_ids(llm, text, random.randint(20, 40))
    return passage + passage[:random.randint(3, len(passage) // 2)]


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def completions(outs) -> list[list[tuple]]:
    return [[(c.token_ids, c.finish_reason, c.stop_reason, c.text) for c in o.outputs] for o in outs]


def accepted(llm: LLM) -> int:
    return llm.engine.speculator.counters.num_accepted_tokens


def assert_clean(llm: LLM, sequences: list[list[int]]) -> None:
    """Every page back but the prefix cache's, every cached prefix a prefix of a real sequence
    (prompt and output, never a rejected draft), the KV state consistent."""
    engine = llm.engine
    engine.kv_manager.check_consistency()
    stats = engine.kv_manager.stats()
    assert stats.num_used == stats.num_cached and stats.usage == 0 and not engine.scheduler.has_work()
    assert_cached_real(engine.kv_manager, sequences)


def assert_cached_real(kv_manager, sequences: list[list[int]]) -> None:
    """Every prefix ``kv_manager``'s cache holds is a prefix of one of ``sequences``."""
    real = {()} | {tuple(s[:n]) for s in sequences for n in range(0, len(s) + 1, PAGE)}
    for node in kv_manager.radix.nodes():
        path, n = (), node
        while n.parent is not None:
            path, n = n.key + path, n.parent
        assert path in real, f"a cached prefix of {len(path)} tokens no request holds"


class Steps:
    """Records what each forward ran: per step, the number of drafts of each scheduled sequence
    (None: a prefill chunk)."""

    def __init__(self, llm: LLM) -> None:
        self.runner = llm.engine.runner
        self.steps: list[list[int | None]] = []

    def __enter__(self) -> Steps:
        execute = self.runner.execute

        def spied(step):
            self.steps.append([len(s.drafts or ()) if not s.seq.in_prefill else None for s in step.scheduled])
            return execute(step)
        self.runner.execute = spied
        return self

    def __exit__(self, *exc) -> None:
        del self.runner.execute


def test_greedy_equals_decoding_without_drafts_over_chunks_and_prefix_hits(pair, eval_text, seed):
    plain, spec = pair
    spec.engine.kv_manager.reset_prefix_cache()  # what earlier tests left
    prompts = [repetitive(plain, eval_text) for _ in range(3)] + [text_ids(plain, eval_text, 30) for _ in range(2)]
    params = [greedy(random.randint(16, 40), n=random.choice([1, 1, 2])) for _ in prompts]
    want = plain.generate(prompts, params)
    before = accepted(spec)
    with Steps(spec) as record:
        got = spec.generate(prompts, params)
    assert completions(got) == completions(want)
    assert accepted(spec) > before
    # drafted decodes shared steps with prefill chunks and with decodes that had none
    assert any(any(n for n in step if n) and any(not n for n in step) for step in record.steps)
    again = spec.generate(prompts, params)  # every prompt now hits the prefix cache
    assert all(o.num_cached_tokens > 0 for o in again)
    assert completions(again) == completions(want)
    spec.engine.kv_manager.check_consistency()
    assert_clean(spec, [o.prompt_token_ids + c.token_ids for o in want for c in o.outputs])


@pytest.mark.parametrize("model", MODELS)
def test_greedy_equals_decoding_without_drafts_under_preemption(shared_dir, model, eval_text, seed):
    path = shared_dir / "models" / model
    plain, spec = make(path, False, num_pages=200), make(path, True, num_pages=36, max_num_batched_tokens=64)
    prompts = [repetitive(plain, eval_text) for _ in range(4)]
    params = greedy(24)
    got = spec.generate(prompts, params)
    assert spec.engine.stats().num_preemptions > 0 and accepted(spec) > 0
    assert completions(got) == completions(plain.generate(prompts, params))
    spec.engine.kv_manager.reset_prefix_cache()
    assert spec.engine.kv_manager.stats().num_free == spec.engine.kv_manager.stats().num_usable


def run_with_aborts(llm: LLM, prompts, params, abort_after: dict[int, int]) -> dict[str, list]:
    """Step by step; request i is aborted once it has ``abort_after[i]`` tokens. What each ended with."""
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params, stream=False)
    ended = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            ended[out.request_id] = completions([out])[0]
        for i, k in abort_after.items():
            req = engine.requests.get(f"r{i}")
            if req is not None and len(req.seqs[0].output_token_ids) >= k:
                ended[f"r{i}"] = completions([engine.abort_request(f"r{i}")])[0]
    return ended


def test_aborts_mid_run_leave_the_others_unchanged_and_every_page_back(pair, eval_text, seed):
    plain, spec = pair
    prompts = [repetitive(plain, eval_text) for _ in range(4)]
    params = greedy(30)
    abort_after = {i: random.randint(2, 20) for i in random.sample(range(4), 2)}
    got = run_with_aborts(spec, prompts, params, abort_after)
    want = completions(plain.generate(prompts, params))
    for i in range(4):
        tokens, reason = got[f"r{i}"][0][:2]
        if i in abort_after:
            assert reason == "abort" and tokens == want[i][0][0][:len(tokens)]
            assert len(tokens) >= abort_after[i]
        else:
            assert got[f"r{i}"] == want[i]
    spec.engine.kv_manager.reset_prefix_cache()
    assert spec.engine.kv_manager.stats().num_free == spec.engine.kv_manager.stats().num_usable
    spec.engine.kv_manager.check_consistency()


def kept_runs(llm: LLM, prompt: list[int], params: SamplingParams) -> tuple[list[int], list[range]]:
    """The greedy output and, per step that added more than one token, the positions it added."""
    engine = llm.engine
    engine.add_request("runs", prompt, params, stream=True)
    runs, seen, tokens = [], 0, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = out.outputs[0].token_ids
            if len(tokens) - seen > 1:
                runs.append(range(seen, len(tokens)))
            seen = len(tokens)
    return tokens, runs


def test_stops_inside_a_kept_run_end_where_they_would_without_drafts(qwen_pair, eval_text, seed):
    plain, spec = qwen_pair
    for _ in range(20):  # a prompt whose output has a run of kept drafts with a first-seen token inside
        prompt = repetitive(plain, eval_text)
        tokens, runs = kept_runs(spec, prompt, greedy(40))
        inside = [i for r in runs for i in r[:-1] if tokens.index(tokens[i]) == i
                  and spec.tokenizer.decode(tokens[i:i + 1]).strip()]
        if inside:
            break
    else:
        pytest.fail("no kept run with a first-seen token inside")
    i = random.choice(inside)
    text = spec.tokenizer.decode(tokens)
    piece = spec.tokenizer.decode(tokens[i:i + 1]).strip()
    cases = [greedy(40, stop_token_ids=[tokens[i]]), greedy(i + 1),
             SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[piece])]
    for params in cases:
        want = completions(plain.generate([prompt], params))
        assert completions(spec.generate([prompt], params)) == want, params
    assert want[0][0][1] == "stop" or text.find(piece) < len(spec.tokenizer.decode(tokens[:i]))  # it did stop
    spec.engine.kv_manager.check_consistency()


def test_logprobs_of_kept_tokens_equal_those_without_drafts(qwen_pair, eval_text, seed):
    plain, spec = qwen_pair
    prompts = [repetitive(plain, eval_text) for _ in range(3)]
    params = greedy(24, logprobs=3)
    before = accepted(spec)
    got, want = spec.generate(prompts, params), plain.generate(prompts, params)
    assert accepted(spec) > before
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for a, b in zip(g.outputs[0].logprobs, w.outputs[0].logprobs, strict=True):
            assert a.keys() == b.keys() and all(math.isclose(a[t], b[t], abs_tol=1e-4) for t in a)


def test_seeded_sampling_repeats_whatever_the_batch(qwen_pair, eval_text, seed):
    """Per-request seeds drive the acceptance draws too: a seeded request gives the same tokens alone
    and in a batch (its drafts depend on its own tokens only), with penalties, bias, min_tokens,
    top-k/p and n > 1; low temperatures keep drafts."""
    _, spec = qwen_pair
    spec.engine.kv_manager.reset_prefix_cache()  # what earlier tests left
    prompt = repetitive(spec, eval_text)
    params = SamplingParams(temperature=0.3, top_p=0.95, top_k=50, seed=seed, max_tokens=24, n=2,
                            repetition_penalty=1.05, presence_penalty=0.1, min_tokens=5, logprobs=1,
                            logit_bias={random.randrange(4096): 1.0})
    before = accepted(spec)
    alone = spec.generate([prompt], params)
    others = [repetitive(spec, eval_text) for _ in range(3)]
    mixed = spec.generate([*others[:2], prompt, others[2]],
                          [SamplingParams(temperature=1.0, max_tokens=20), greedy(10), params, greedy(16)])
    assert completions(alone) == completions([mixed[2]])
    assert accepted(spec) > before
    assert_clean(spec, [o.prompt_token_ids + c.token_ids for o in [*alone, *mixed] for c in o.outputs])
