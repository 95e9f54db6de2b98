"""Structured outputs through the official openai client against a live tiny-qwen3-py server: its
text is noise, yet every output matches the schema, regex or choice it was given, streamed or not;
a grammar that does not compile is a 400 naming the field, and the server serves on."""

from __future__ import annotations

import json
import random
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from random_schemas import random_schema

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

MAX_TOKENS = 480  # the test server's context is 512


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0, timeout=300)


def _chat(server, seed: int, **kw):
    return _client(server).chat.completions.create(
        model=server.model_name, messages=[{"role": "user", "content": "Give me JSON."}], temperature=1.0,
        seed=seed, max_tokens=MAX_TOKENS, **kw)


def test_json_schemas_hold_on_chat_and_completions(tiny_server, seed):
    """Random schemas at temperature 1, through each field that carries one, run side by side."""
    rng = random.Random(seed)
    schemas = [random_schema(rng) for _ in range(8)]
    c = _client(tiny_server)

    def run(i: int) -> str:
        s, sd = schemas[i], seed + i
        if i % 4 == 0:
            r = _chat(tiny_server, sd, response_format={"type": "json_schema",
                                                        "json_schema": {"name": "out", "schema": s, "strict": True}})
            return r.choices[0].message.content, r.choices[0].finish_reason
        if i % 4 == 1:
            r = _chat(tiny_server, sd, extra_body={"structured_outputs": {"json": s}})
            return r.choices[0].message.content, r.choices[0].finish_reason
        body = {"guided_json": s} if i % 4 == 2 else {"guided_json": json.dumps(s)}
        r = c.completions.create(model=tiny_server.model_name, prompt="data = ", temperature=1.0, seed=sd,
                                 max_tokens=MAX_TOKENS, extra_body=body)
        return r.choices[0].text, r.choices[0].finish_reason

    with ThreadPoolExecutor(len(schemas)) as pool:
        results = list(pool.map(run, range(len(schemas))))
    for schema, (text, finish) in zip(schemas, results):
        assert finish == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)


def test_json_object_regex_and_choice(tiny_server, seed):
    rng = random.Random(seed)
    # json_object bounds no object's size: at temperature 1 the tiny model sometimes nests past max_tokens (once in
    # five CI runs), so of five answers each that ends must be an object, and one at least must end
    with ThreadPoolExecutor(5) as pool:
        answers = list(pool.map(lambda k: _chat(tiny_server, seed + k, response_format={"type": "json_object"}),
                                range(5)))
    ended = [a.choices[0].message.content for a in answers if a.choices[0].finish_reason == "stop"]
    assert ended and all(isinstance(json.loads(text), dict) for text in ended)
    c = _client(tiny_server)
    n = rng.randint(1, 5)
    regex = rf"[A-Z]{{{n}}}[0-9]{{1,3}}"
    for extra in ({"guided_regex": regex}, {"structured_outputs": {"regex": regex}}):
        out = c.completions.create(model=tiny_server.model_name, prompt="id: ", max_tokens=40, temperature=1.0,
                                   seed=seed, n=2, extra_body=extra)
        for ch in out.choices:
            assert re.fullmatch(regex, ch.text) and ch.finish_reason == "stop"
    words = ["".join(rng.choice("pqr stu") for _ in range(rng.randint(1, 6))) for _ in range(3)]
    r = _chat(tiny_server, seed, extra_body={"guided_choice": words})
    assert r.choices[0].message.content in words


def test_a_streamed_json_schema_answer_holds(tiny_server, seed):
    schema = random_schema(random.Random(seed))
    chunks = list(_chat(tiny_server, seed, stream=True, extra_body={"guided_json": schema}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == ["stop"]
    jsonschema.validate(json.loads(text), schema)


def test_the_native_route_takes_structured_outputs(tiny_server):
    r = httpx.post(tiny_server.url + "/generate", headers=tiny_server.headers, timeout=120,
                   json={"text": "x", "sampling_params": {"max_new_tokens": 20, "structured_outputs":
                                                          {"choice": ["yes", "no"]}}})
    assert r.status_code == 200 and r.json()["text"] in ("yes", "no")


# a choice among 40,000 strings compiles for seconds, past the test server's 1 s limit
CATASTROPHIC = ["".join(random.Random(i).choice("abcdefghijklmnop") for _ in range(12)) for i in range(40000)]

CASES = [
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "o", "schema": {"type": "strin"}}}},
     "response_format.json_schema.schema"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
     "response_format.json_schema.name"),
    ("chat", {"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ("chat", {"guided_json": "{not json"}, "guided_json"),
    ("chat", {"guided_choice": []}, "guided_choice"),
    ("chat", {"guided_grammar": "root ::= undefined"}, "guided_grammar"),
    ("chat", {"guided_choice": CATASTROPHIC}, "guided_choice"),
    ("completion", {"guided_regex": "(("}, "guided_regex"),
    ("completion", {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ("completion", {"structured_outputs": {}}, "structured_outputs"),
    ("completion", {"structured_outputs": {"json": {"type": "object", "properties": 3}}}, "structured_outputs.json"),
    ("completion", {"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
    ("completion", {"guided_regex": "a+", "ignore_eos": True}, "ignore_eos"),
    ("completion", {"guided_regex": "a+", "min_tokens": 1}, "min_tokens"),
    ("generate", {"structured_outputs": {"regex": "(("}}, "sampling_params.structured_outputs.regex"),
]


@pytest.mark.parametrize("route,change,param", CASES, ids=[f"{c[0]}-{c[2]}-{i}" for i, c in enumerate(CASES)])
def test_a_grammar_that_cannot_run_is_a_400_naming_the_field(tiny_server, route, change, param):
    if route == "chat":
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **change}
    elif route == "completion":
        path, body = "/v1/completions", {"prompt": "x", "max_tokens": 4, **change}
    else:
        path, body = "/generate", {"text": "x", "sampling_params": {"max_new_tokens": 4, **change}}
    r = httpx.post(tiny_server.url + path, headers=tiny_server.headers, json=body, timeout=120)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    ok = httpx.post(tiny_server.url + "/v1/completions", headers=tiny_server.headers, timeout=120,
                    json={"prompt": "x", "max_tokens": 8, "guided_regex": "[0-9]{2}"})
    assert ok.status_code == 200 and re.fullmatch("[0-9]{2}", ok.json()["choices"][0]["text"])
