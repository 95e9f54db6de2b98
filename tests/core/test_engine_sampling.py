"""End-to-end sampling behaviour through the public API: seeds, n > 1, stop rules, min_tokens."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams

PAGE_SIZE = 4


@pytest.fixture(scope="module")
def llm(tiny_qwen3) -> LLM:
    return LLM(tiny_qwen3, dtype="float32", page_size=PAGE_SIZE, num_pages=1024, chunked_prefill_size=64,
               enable_prefix_caching=False, max_num_seqs=32, progress=False)


def random_prompt(llm: LLM, text: str, length: int) -> list[int]:
    """``length`` token ids from a random place in the evaluation text."""
    start = random.randrange(len(text) - 40 * length)
    ids = llm.tokenizer.encode(text[start: start + 40 * length])
    assert len(ids) >= length
    return ids[:length]


def random_params() -> SamplingParams:
    return SamplingParams(temperature=random.choice([0.0, 0.5, 1.0, 1.3]), top_p=random.choice([1.0, 0.7]),
                          top_k=random.choice([0, 5, 50]), seed=random.choice([None, random.randrange(2**31)]),
                          presence_penalty=random.choice([0.0, 1.0]), repetition_penalty=random.choice([1.0, 1.2]),
                          max_tokens=random.randint(1, 32), ignore_eos=True)


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def test_seeded_sampling_is_independent_of_the_batch(llm, seed, eval_text):
    prompt = random_prompt(llm, eval_text, random.randint(8, 30))
    target = SamplingParams(temperature=0.8, top_p=0.9, seed=seed, max_tokens=32, ignore_eos=True)
    alone = llm.generate([prompt], target)[0].outputs[0].token_ids
    assert len(alone) == 32

    others = [random_prompt(llm, eval_text, random.randint(3, 50)) for _ in range(6)]
    first = llm.generate([prompt] + others[:3], [target] + [random_params() for _ in range(3)])
    last = llm.generate(others[3:] + [prompt], [random_params() for _ in range(3)] + [target])
    assert first[0].outputs[0].token_ids == alone
    assert last[-1].outputs[0].token_ids == alone

    other_seed = SamplingParams(temperature=0.8, top_p=0.9, seed=seed + 1, max_tokens=32, ignore_eos=True)
    assert llm.generate([prompt], other_seed)[0].outputs[0].token_ids != alone


def test_n_siblings_share_the_prompt_and_its_first_logits(llm, seed, eval_text):
    engine = llm.engine
    length = random.randint(3, 8) * PAGE_SIZE + random.randint(1, PAGE_SIZE - 1)  # ends inside a page
    prompt = random_prompt(llm, eval_text, length)
    free_before = engine.kv_manager.stats().num_free
    params = SamplingParams(n=4, temperature=1.0, seed=seed, max_tokens=12, ignore_eos=True, logprobs=5)
    req = engine.add_request(f"fork-{seed}", prompt, params)

    while not req.seqs[0].output_token_ids:  # the whole prompt fits one chunk: prefill, first tokens, fork
        engine.step()  # (with overlap_decode they reach the host a step later, the next launched on the same pages)
    full, one_seq_pages = length // PAGE_SIZE, -(-length // PAGE_SIZE)
    assert all(len(s.output_token_ids) == 1 for s in req.seqs)
    pages = [engine.kv_manager.pages(s) for s in req.seqs]
    assert {tuple(p[:full]) for p in pages} == {tuple(pages[0][:full])}
    assert len({p for t in pages for p in t}) == one_seq_pages + 3  # a private copy of the last page each
    assert free_before - engine.kv_manager.stats().num_free == one_seq_pages + 3

    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    (out,) = outputs
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 12 and c.finish_reason == "length" for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1

    # One logits row fed every sibling's first draw: the top-5 logprobs agree exactly.
    firsts = [c.logprobs[0] for c in out.outputs]
    top = [sorted(f.items(), key=lambda kv: -kv[1])[:5] for f in firsts]
    assert all(t == top[0] for t in top)
    assert engine.kv_manager.stats().num_free == free_before
    engine.kv_manager.check_consistency()


def test_n_greedy_completions_equal_n1(llm, eval_text, seed):
    prompt = random_prompt(llm, eval_text, random.randint(5, 30))
    single = llm.generate([prompt], greedy(20, ignore_eos=True))[0].outputs[0]
    out = llm.generate([prompt], greedy(20, ignore_eos=True, n=3))[0]
    assert len(out.outputs) == 3
    for c in out.outputs:
        assert c.token_ids == single.token_ids
        assert c.text == single.text


def _boundary_stop(llm: LLM, tokens: list[int], text: str) -> tuple[str, int] | None:
    """A 4-character stop string straddling a token boundary of ``text``, first seen there and
    complete before the last token (so cutting there drops tokens)."""
    candidates = []
    before_last = len(llm.tokenizer.decode(tokens[:-1]))
    for k in range(1, len(tokens)):
        head = llm.tokenizer.decode(tokens[:k])
        c = len(head)
        if not (2 <= c <= min(len(text), before_last) - 2 and text.startswith(head)):
            continue
        stop = text[c - 2: c + 2]
        if text.find(stop) == c - 2:
            candidates.append((stop, c - 2))
    return random.choice(candidates) if candidates else None


def test_stop_string_split_across_tokens(llm, eval_text, seed):
    for _ in range(20):
        prompt = random_prompt(llm, eval_text, random.randint(5, 30))
        ref = llm.generate([prompt], greedy(24, ignore_eos=True))[0].outputs[0]
        found = _boundary_stop(llm, ref.token_ids, ref.text)
        if found:
            break
    else:
        pytest.fail("no greedy continuation had a usable token boundary")
    stop, at = found

    cut = llm.generate([prompt], greedy(24, ignore_eos=True, stop=[stop]))[0].outputs[0]
    assert cut.text == ref.text[:at]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.token_ids == ref.token_ids[: len(cut.token_ids)] and len(cut.token_ids) < len(ref.token_ids)

    kept = llm.generate([prompt], greedy(24, ignore_eos=True, stop=[stop], include_stop_str_in_output=True))
    kept = kept[0].outputs[0]
    assert kept.text == ref.text[: at + len(stop)]
    assert kept.finish_reason == "stop" and kept.stop_reason == stop


def test_min_tokens_holds_back_eos(llm, eval_text, seed):
    eos = min(llm.tokenizer.eos_token_ids)
    prompt = random_prompt(llm, eval_text, random.randint(5, 30))
    push_eos = {eos: 100.0}
    eager = llm.generate([prompt], greedy(20, logit_bias=push_eos))[0].outputs[0]
    assert eager.token_ids == [eos] and eager.finish_reason == "stop"

    m = random.randint(2, 10)
    out = llm.generate([prompt], greedy(20, logit_bias=push_eos, min_tokens=m))[0].outputs[0]
    assert len(out.token_ids) >= m
    assert eos not in out.token_ids[:m]
    assert out.token_ids[-1] == eos and out.finish_reason == "stop" and out.stop_reason is None


def test_stop_token_id_ends_at_that_token(llm, eval_text, seed):
    prompt = random_prompt(llm, eval_text, random.randint(5, 30))
    ref = llm.generate([prompt], greedy(16, ignore_eos=True))[0].outputs[0].token_ids
    third = ref[2]
    out = llm.generate([prompt], greedy(16, ignore_eos=True, stop_token_ids=[third]))[0].outputs[0]
    end = ref.index(third) + 1
    assert out.token_ids == ref[:end]
    assert out.finish_reason == "stop" and out.stop_reason == third


def test_greedy_fast_path_equals_greedy_with_logprobs(llm, eval_text, seed):
    """Plain greedy rows skip the general sampler; asking for logprobs sends the same rows through it."""
    prompts = [random_prompt(llm, eval_text, random.randint(3, 40)) for _ in range(5)]
    fast = llm.generate(prompts, greedy(16, ignore_eos=True))
    full = llm.generate(prompts, greedy(16, ignore_eos=True, logprobs=0))
    for a, b in zip(fast, full):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs is None and len(b.outputs[0].logprobs) == 16


def test_a_stop_string_only_the_last_flush_reveals_still_stops(llm):
    """The first byte of 'é' alone decodes to U+FFFD and is held back as an unfinished character;
    when max_tokens ends the sequence, the flushed text holds the stop string: it is a stop."""
    first_byte = llm.tokenizer.encode("é")[0]
    out = llm.generate(["x"], greedy(1, logit_bias={first_byte: 100.0}, stop=["\ufffd"]))[0].outputs[0]
    assert out.token_ids == [first_byte]
    assert (out.text, out.finish_reason, out.stop_reason) == ("", "stop", "\ufffd")
