"""End-to-end scheduler behaviour through the public API: aborts, prefix caching, preemption,
chunked prefill and request validation, each checked against an unconstrained engine."""

from __future__ import annotations

import math
import random

import pytest

from engine import LLM, SamplingParams
from engine.core.sequence import SeqStatus

PAGE_SIZE = 4


def make_llm(model, **kw) -> LLM:
    opts = dict(dtype="float32", page_size=PAGE_SIZE, num_pages=512, chunked_prefill_size=64,
                enable_prefix_caching=True, max_num_seqs=32, progress=False)
    return LLM(model, **{**opts, **kw})


@pytest.fixture(scope="module")
def plain_llm(tiny_qwen3) -> LLM:
    """The reference: no prefix cache, pages and chunks to spare."""
    return make_llm(tiny_qwen3, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def cached_llm(tiny_qwen3) -> LLM:
    return make_llm(tiny_qwen3)


def random_prompt(llm: LLM, text: str, length: int) -> list[int]:
    """``length`` token ids from a random place in the evaluation text."""
    start = random.randrange(len(text) - 40 * length)
    ids = llm.tokenizer.encode(text[start: start + 40 * length])
    assert len(ids) >= length
    return ids[:length]


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


# -- abort ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_abort_mid_generation_returns_every_page(tiny_qwen3, eval_text, seed, prefix_caching):
    # step by step states: each step read before the next (tests/core/test_overlap.py aborts with one in flight)
    llm = make_llm(tiny_qwen3, chunked_prefill_size=8, max_num_seqs=2, enable_prefix_caching=prefix_caching,
                   overlap_decode=False)
    engine = llm.engine
    start = engine.kv_manager.stats().num_free

    decoding = engine.add_request("decoding", random_prompt(llm, eval_text, random.randint(2, 8)), greedy(50))
    engine.step()
    prefilling = engine.add_request("prefilling", random_prompt(llm, eval_text, random.randint(20, 40)), greedy(50))
    waiting = engine.add_request("waiting", random_prompt(llm, eval_text, random.randint(2, 20)), greedy(50))
    for _ in range(2):
        engine.step()

    (d,), (p,), (w,) = decoding.seqs, prefilling.seqs, waiting.seqs
    assert d.status is SeqStatus.RUNNING and not d.in_prefill and len(d.output_token_ids) == 3
    assert p.status is SeqStatus.RUNNING and p.in_prefill and p.num_computed == 16
    assert w.status is SeqStatus.WAITING and not engine.kv_manager.pages(w)
    assert engine.kv_manager.stats().num_free < start

    ids = ["decoding", "prefilling", "waiting"]
    random.shuffle(ids)
    for rid in ids:
        out = engine.abort_request(rid)
        assert out.finished and out.outputs[0].finish_reason == "abort"
    assert not engine.has_unfinished_requests() and not engine.scheduler.has_work()
    if prefix_caching:
        engine.kv_manager.reset_prefix_cache()
        assert engine.kv_manager.stats().num_cached == 0
    assert engine.kv_manager.stats().num_free == start
    engine.kv_manager.check_consistency()


# -- prefix caching ---------------------------------------------------------------------------


def test_prefix_cache_hits_count_whole_pages_and_keep_outputs(cached_llm, plain_llm, eval_text, seed):
    engine = cached_llm.engine
    engine.kv_manager.reset_prefix_cache()
    prefix = random_prompt(cached_llm, eval_text, 3 * PAGE_SIZE)
    first = random_prompt(cached_llm, eval_text, random.randint(5, 10))
    second = random_prompt(cached_llm, eval_text, random.randint(5, 10))
    while second[0] == first[0]:
        second = random_prompt(cached_llm, eval_text, random.randint(5, 10))
    mid_page = first[:2] + [t for t in second if t != first[2]][:4]  # diverges 2 tokens into page 4
    prompts = [prefix + first, prefix + second, prefix + mid_page]
    params = greedy(12)

    outs = []
    for prompt in prompts:
        hits = engine.kv_manager.stats().prefix_hits
        (out,) = cached_llm.generate([prompt], params)
        outs.append(out)
        assert engine.kv_manager.stats().prefix_hits - hits == out.num_cached_tokens
    assert outs[0].num_cached_tokens == 0
    assert outs[1].num_cached_tokens == 3 * PAGE_SIZE
    assert outs[2].num_cached_tokens == 3 * PAGE_SIZE  # 14 tokens match; the partial 4th page does not count
    assert token_ids(outs) == token_ids(plain_llm.generate(prompts, params))


# -- preemption -------------------------------------------------------------------------------


def test_preemption_under_page_pressure_keeps_outputs(tiny_qwen3, plain_llm, eval_text, seed):
    max_tokens = 24
    prompts = [random_prompt(plain_llm, eval_text, random.randint(6, 12)) for _ in range(8)]
    longest = max(map(len, prompts)) + max_tokens
    num_pages = 1 + math.ceil(48 / PAGE_SIZE)  # room for one sequence of 48 tokens, not for 8 of ~30
    assert longest <= 48
    tight = make_llm(tiny_qwen3, num_pages=num_pages)
    engine = tight.engine

    outs = tight.generate(prompts, greedy(max_tokens))
    assert engine.scheduler.stats.num_preemptions > 0
    assert all(o.finished and len(o.outputs[0].token_ids) == max_tokens for o in outs)
    assert token_ids(outs) == token_ids(plain_llm.generate(prompts, greedy(max_tokens)))
    kv = engine.kv_manager.stats()
    assert kv.num_free + kv.num_cached == kv.num_usable
    engine.kv_manager.check_consistency()


# -- chunked prefill --------------------------------------------------------------------------


def test_chunked_prefill_sizes_agree(tiny_qwen3, eval_text, seed):
    llms = {size: make_llm(tiny_qwen3, chunked_prefill_size=size) for size in (1, 7, 64, None)}
    prompts = [random_prompt(llms[None], eval_text, n)
               for n in (random.randint(2, 9), random.randint(10, 30), random.randint(30, 70))]
    params = greedy(8, prompt_logprobs=2)
    runs = {size: llm.generate(prompts, params) for size, llm in llms.items()}

    reference = runs[None]
    for prompt, out in zip(prompts, reference):
        lp = out.prompt_logprobs
        assert len(lp) == len(prompt) and lp[0] is None
        for i in range(1, len(prompt)):
            assert prompt[i] in lp[i] and lp[i][prompt[i]] <= 0.0
    for size, outs in runs.items():
        assert token_ids(outs) == token_ids(reference), f"chunk size {size}"
        for out, ref in zip(outs, reference):
            assert out.prompt_logprobs[0] is None
            for got, want in zip(out.prompt_logprobs[1:], ref.prompt_logprobs[1:]):
                assert got.keys() == want.keys(), f"chunk size {size}"
                assert [got[k] for k in want] == pytest.approx([want[k] for k in want], abs=1e-4)


def test_without_chunking_a_prefix_hit_left_waiting_for_room_runs_a_step_later(tiny_qwen3, plain_llm, eval_text, seed):
    """Whole prompts only: a prompt whose prefix hit leaves more than the rest of the step's budget
    waits, holding nothing, and runs from its hit once there is room."""
    llm = make_llm(tiny_qwen3, chunked_prefill_size=None, max_num_batched_tokens=40)
    cached = random_prompt(llm, eval_text, 30)
    llm.generate([cached], greedy(2))  # its 31 computed tokens cached: 7 whole pages
    prompts = [random_prompt(llm, eval_text, 30), cached + random_prompt(llm, eval_text, 20)]
    outs = llm.generate(prompts, greedy(6))  # 30 tokens, then 22 past the hit do not fit the 10 left
    assert [o.num_cached_tokens for o in outs] == [0, 28]
    assert token_ids(outs) == token_ids(plain_llm.generate(prompts, greedy(6)))
    llm.engine.kv_manager.check_consistency()


# -- validation -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def short_llm(tiny_qwen3) -> LLM:
    return make_llm(tiny_qwen3, max_model_len=64)


@pytest.mark.parametrize("case", ["empty_prompt", "empty_text", "token_too_big", "negative_token",
                                  "max_tokens_past_context", "stop_token_out_of_vocab"])
def test_invalid_requests_raise_naming_the_field(short_llm, eval_text, seed, case):
    engine = short_llm.engine
    vocab = engine.vocab_size
    prompt = random_prompt(short_llm, eval_text, 10)
    bad, params, message = {
        "empty_prompt": ([], greedy(4), r"^prompt must not be empty"),
        "empty_text": ("", greedy(4), r"^prompt must not be empty"),
        "token_too_big": (prompt[:5] + [vocab] + prompt[5:], greedy(4), rf"^prompt token ids .*\[{vocab}\]"),
        "negative_token": ([-1] + prompt, greedy(4), r"^prompt token ids .*\[-1\]"),
        "max_tokens_past_context": (prompt, greedy(64 - 10 + 2), r"^max_tokens 56 exceeds"),
        "stop_token_out_of_vocab": (prompt, greedy(4, stop_token_ids=[3, vocab + 7]), r"^stop_token_ids"),
    }[case]
    free = engine.kv_manager.stats().num_free
    with pytest.raises(ValueError, match=message):
        short_llm.generate([prompt, bad], [greedy(4), params])
    assert not engine.has_unfinished_requests() and not engine.scheduler.has_work()
    assert engine.kv_manager.stats().num_free == free

    (out,) = short_llm.generate([prompt], greedy(64 - 10))
    assert out.finished and len(out.outputs[0].token_ids) == 64 - 10


def test_prompt_logprobs_survive_preemption(tiny_qwen3, eval_text):
    """A preempted request recomputes its prompt; its prompt logprobs are neither lost nor doubled."""
    roomy = LLM(str(tiny_qwen3), dtype="float32", page_size=4, progress=False)
    tight = LLM(str(tiny_qwen3), dtype="float32", page_size=4, num_pages=24, chunked_prefill_size=8,
                progress=False)
    prompts = [random_prompt(roomy, eval_text, n) for n in (30, 33, 35, 31)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, prompt_logprobs=1)
    want, got = roomy.generate(prompts, params), tight.generate(prompts, params)
    assert tight.engine.scheduler.stats.num_preemptions > 0
    for w, g, p in zip(want, got, prompts):
        assert len(g.prompt_logprobs) == len(p)
        assert [sorted(d) if d else d for d in g.prompt_logprobs] == [sorted(d) if d else d for d in w.prompt_logprobs]
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
