"""The official ``openai`` client against live servers of tiny-qwen3-py and the embedded default."""

from __future__ import annotations

import random

import httpx
import openai
import pytest

from engine import LLM, SamplingParams


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0, timeout=120)


def _prompt(seed: int) -> str:
    rng = random.Random(seed)
    words = ["def", "return", "class", "import", "value", "list", "print", "for", "in", "range", "self"]
    return " ".join(rng.choice(words) for _ in range(rng.randint(3, 12)))


def test_completion_usage_is_exact(server, seed):
    c = _client(server)
    prompt = _prompt(seed)
    r = c.completions.create(model=server.model_name, prompt=prompt, max_tokens=7, temperature=0,
                             extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.model == server.model_name
    assert r.choices[0].finish_reason == "length"
    ids = httpx.post(server.url + "/generate", headers=server.headers,
                     json={"text": prompt, "sampling_params": {"max_new_tokens": 7, "temperature": 0,
                                                               "ignore_eos": True}}).json()
    assert r.usage.prompt_tokens == ids["meta_info"]["prompt_tokens"]
    assert r.usage.completion_tokens == 7 == len(ids["output_ids"])
    assert r.usage.total_tokens == r.usage.prompt_tokens + 7
    assert r.choices[0].text == ids["text"]  # greedy: the same text through both routes


def test_streamed_completion_equals_the_whole_one(server, seed):
    c = _client(server)
    prompt = _prompt(seed)
    kw = dict(model=server.model_name, prompt=prompt, max_tokens=12, temperature=0.8, seed=seed % 1000,
              extra_body={"ignore_eos": True})
    whole = c.completions.create(**kw)
    chunks = list(c.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == whole.choices[0].text  # the same seed gives the same text
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_chat_stream_and_whole_agree(server, seed):
    c = _client(server)
    msgs = [{"role": "system", "content": "You write Python."},
            {"role": "user", "content": [{"type": "text", "text": _prompt(seed)}]}]
    whole = c.chat.completions.create(model=server.model_name, messages=msgs, max_completion_tokens=10,
                                      temperature=0, extra_body={"ignore_eos": True})
    assert whole.choices[0].message.role == "assistant" and whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 10
    chunks = list(c.chat.completions.create(model=server.model_name, messages=msgs, max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == whole.choices[0].message.content
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()


def test_n_completions_with_seed_are_reproducible_and_distinct(server, seed):
    c = _client(server)
    kw = dict(model=server.model_name, prompt=_prompt(seed), max_tokens=8, n=3, temperature=1.0, seed=seed % 997,
              extra_body={"ignore_eos": True})
    a, b = c.completions.create(**kw), c.completions.create(**kw)
    assert sorted(ch.index for ch in a.choices) == [0, 1, 2]
    assert [ch.text for ch in a.choices] == [ch.text for ch in b.choices]
    assert a.usage.completion_tokens == 24
    chat = c.chat.completions.create(model=server.model_name, messages=[{"role": "user", "content": "hi"}],
                                     max_tokens=4, n=2, temperature=1.0, seed=5, extra_body={"ignore_eos": True})
    assert [ch.index for ch in chat.choices] == [0, 1] and chat.usage.completion_tokens == 8


def test_logprobs(server, seed):
    c = _client(server)
    r = c.completions.create(model=server.model_name, prompt=_prompt(seed), max_tokens=5, temperature=0, logprobs=3,
                             extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    if not any(t.startswith("token_id:") for t in lp.tokens):  # pieces of a character have no text
        assert "".join(lp.tokens) == r.choices[0].text
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and 3 <= len(top) <= 4
        assert max(top.values()) == pytest.approx(chosen)  # greedy picks the top token
    chat = c.chat.completions.create(model=server.model_name, messages=[{"role": "user", "content": "hello"}],
                                     max_tokens=4, temperature=0, logprobs=True, top_logprobs=2,
                                     extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 2 for t in content)
    assert all(t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob for t in content)
    if not any(t.token.startswith("token_id:") for t in content):
        assert "".join(t.token for t in content) == chat.choices[0].message.content


def test_echo_with_prompt_logprobs(server, seed):
    c = _client(server)
    prompt = _prompt(seed)
    r = c.completions.create(model=server.model_name, prompt=prompt, max_tokens=3, temperature=0, echo=True,
                             logprobs=1, extra_body={"ignore_eos": True})
    ch = r.choices[0]
    assert ch.text.startswith(prompt)
    n_prompt = r.usage.prompt_tokens
    assert len(ch.logprobs.tokens) == n_prompt + 3
    assert ch.logprobs.token_logprobs[0] is None and all(v <= 0 for v in ch.logprobs.token_logprobs[1:])


def test_stop_string_cuts_and_finishes(server, seed):
    c = _client(server)
    prompt = _prompt(seed)
    free = c.completions.create(model=server.model_name, prompt=prompt, max_tokens=24, temperature=0,
                                extra_body={"ignore_eos": True}).choices[0].text
    if len(free) < 4:
        pytest.skip("the greedy continuation is too short to cut")
    stop = free[len(free) // 2: len(free) // 2 + 2]
    cut = free[:free.index(stop)]
    for stream in (False, True):
        if stream:
            chunks = list(c.completions.create(model=server.model_name, prompt=prompt, max_tokens=24, temperature=0,
                                               stop=[stop], stream=True))
            text = "".join(x.choices[0].text for x in chunks)
            reason = chunks[-1].choices[0].finish_reason
        else:
            ch = c.completions.create(model=server.model_name, prompt=prompt, max_tokens=24, temperature=0,
                                      stop=[stop]).choices[0]
            text, reason = ch.text, ch.finish_reason
        assert (text, reason) == (cut, "stop")


def test_several_prompts_and_token_prompts(server):
    c = _client(server)
    r = c.completions.create(model=server.model_name, prompt=["def a():", "class B:"], max_tokens=3, n=2,
                             temperature=0, extra_body={"ignore_eos": True})
    assert sorted(ch.index for ch in r.choices) == [0, 1, 2, 3]
    by = {ch.index: ch.text for ch in r.choices}
    assert by[0] == by[1] and by[2] == by[3]  # greedy: the n copies agree
    ids = c.completions.create(model=server.model_name, prompt=[[1, 2, 3], [4, 5]], max_tokens=2, temperature=0,
                               extra_body={"ignore_eos": True})
    assert ids.usage.prompt_tokens == 5 and ids.usage.completion_tokens == 4


def test_models_route(server):
    models = _client(server).models.list()
    (m,) = models.data
    assert m.id == server.model_name
    assert m.model_extra["max_model_len"] > 0


def test_greedy_through_the_server_equals_llm_generate(tiny_server, tiny_qwen3, seed):
    prompts = [_prompt(seed + i) for i in range(3)]
    llm = LLM(str(tiny_qwen3), max_model_len=512, progress=False)
    want = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    c = _client(tiny_server)
    for p, w in zip(prompts, want):
        got = c.completions.create(model=tiny_server.model_name, prompt=p, max_tokens=20, temperature=0,
                                   extra_body={"ignore_eos": True})
        assert got.choices[0].text == w.outputs[0].text
        ids = httpx.post(tiny_server.url + "/generate", headers=tiny_server.headers,
                         json={"input_ids": w.prompt_token_ids,
                               "sampling_params": {"max_tokens": 20, "temperature": 0, "ignore_eos": True}}).json()
        assert ids["output_ids"] == w.outputs[0].token_ids
