"""Bad inputs get a 4xx naming the field, before any allocation, and the server keeps serving."""

from __future__ import annotations

import json as _json

import httpx
import pytest

OK_COMPLETION = {"prompt": "def f(x):", "max_tokens": 2}
LONG_PROMPT = "hello " * 2000  # past the test server's 512-token context

COMPLETION_CASES = [
    ({"n": 5}, 400, "n"),
    ({"n": 10**9}, 400, "n"),
    ({"logprobs": 6}, 400, "logprobs"),
    ({"max_tokens": 600}, 400, "max_tokens"),
    ({"max_tokens": 0}, 400, "max_tokens"),
    ({"max_tokens": -1}, 400, "max_tokens"),
    ({"min_tokens": 5, "max_tokens": 2}, 400, "min_tokens"),
    ({"max_tokens": None, "min_tokens": 10**9}, 400, "min_tokens"),
    ({"prompt": LONG_PROMPT}, 400, "prompt"),
    ({"prompt": [999999]}, 400, "prompt"),
    ({"prompt": [-1]}, 400, "prompt"),
    ({"prompt": [[-1]]}, 400, "prompt"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": ["ok", ""]}, 400, "prompt"),
    ({"stop_token_ids": [999999]}, 400, "stop_token_ids"),
    ({"stop_token_ids": [-3]}, 400, "stop_token_ids"),
    ({"logit_bias": {"999999": 1.0}}, 400, "logit_bias"),
    ({"logit_bias": {"-1": 1.0}}, 400, "logit_bias"),
    ({"stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"temperature": "hot"}, 400, "temperature"),
    ({"top_p": 0}, 400, "top_p"),
    ({"model": "no-such-model"}, 404, "model"),
    ({"seed": 2**64}, 400, "seed"),
    ({"seed": -2**63 - 1}, 400, "seed"),
    ({"top_k": 2**64}, 400, "top_k"),
    ({"n": 10**30}, 400, "n"),
    ({"max_tokens": 2**70}, 400, "max_tokens"),
    ({"min_tokens": 2**64}, 400, "min_tokens"),
    ({"logprobs": 2**64}, 400, "logprobs"),
    ({"stop_token_ids": [2**64]}, 400, "stop_token_ids.0"),
    ({"prompt": [2**64]}, 400, "prompt"),
    ({"prompt": "a\ud800b"}, 400, "prompt"),
    ({"prompt": ["ok", "\udfff"]}, 400, "prompt.1"),
    ({"stop": ["\ud800"]}, 400, "stop.0"),
    ({"temperature": float("inf")}, 400, "temperature"),
    ({"repetition_penalty": float("inf")}, 400, "repetition_penalty"),
    ({"repetition_penalty": float("-inf")}, 400, "repetition_penalty"),
    ({"top_p": float("nan")}, 400, "top_p"),
    ({"presence_penalty": 1e999}, 400, "presence_penalty"),
    ({"logit_bias": {"1": float("inf")}}, 400, "logit_bias.1"),
    ({"temperature": 1e300}, 400, "temperature"),  # finite in float64, inf in the engine's float32
    ({"repetition_penalty": 1e-300}, 400, "repetition_penalty"),
    ({"min_p": -1e39}, 400, "min_p"),
    ({"logit_bias": {str(i): 1.0 for i in range(1025)}}, 400, "logit_bias"),
    ({"stop_token_ids": list(range(1025))}, 400, "stop_token_ids"),
    ({"suffix": "return x"}, 400, "suffix"),
    ({"best_of": 3}, 400, "best_of"),
    ({"prompt": [[5] * 40000]}, 400, "prompt"),  # a body large enough to be parsed off the event loop
]

CHAT_CASES = [
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role"),
    ({"messages": [{"role": "user", "content": 3}]}, 400, "messages.0.content"),
    ({"top_logprobs": 6, "logprobs": True}, 400, "top_logprobs"),
    ({"top_logprobs": 2}, 400, "top_logprobs"),
    ({"max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ({"n": 5}, 400, "n"),
    ({"chat_template": "{{ 7 * 7 }}"}, 400, "chat_template"),
    ({"messages": [{"role": "user", "content": LONG_PROMPT}]}, 400, "prompt"),
    ({"max_completion_tokens": 10**12}, 400, "max_completion_tokens"),
    ({"max_tokens": 10**12}, 400, "max_tokens"),
    ({"max_completion_tokens": 2**64}, 400, "max_completion_tokens"),
    ({"logprobs": True, "top_logprobs": 2**64}, 400, "top_logprobs"),
    ({"seed": 2**64}, 400, "seed"),
    ({"messages": [{"role": "user", "content": "\ud800"}]}, 400, "messages.0.content"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x\udc00"}]}]}, 400,
     "messages.0.content.0.text"),
    ({"messages": [{"role": "user", "content": "hi", "name": "\ud800"}]}, 400, "messages.0.name"),
    ({"temperature": float("inf")}, 400, "temperature"),
    ({"frequency_penalty": float("-inf")}, 400, "frequency_penalty"),
    ({"temperature": 1e300}, 400, "temperature"),
    ({"response_format": {"type": "json_schema"}}, 400, "response_format.json_schema.schema"),
    ({"response_format": {"type": "xml"}}, 400, "response_format.type"),
    ({"tools": {"type": "function", "function": {"name": "f"}}}, 400, "tools"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, 400, "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]}, 400,
     "tools.0.function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/$defs/missing"}}}],
      "tool_choice": "required"}, 400, "tools"),  # a schema that does not compile, where calls are forced
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "tool_choice.function.name"),
    ({"tool_choice": "required"}, 400, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, 400, "tool_choice"),
    ({"functions": [{"name": "f"}]}, 400, "functions"),
    ({"function_call": "auto"}, 400, "function_call"),
]


def _post(server, path: str, headers: dict | None = None, json=None, **kw) -> httpx.Response:
    """POST ``json`` as Python's json writes it: Infinity and NaN as literals, lone surrogates escaped."""
    if json is not None:
        kw["content"] = _json.dumps(json)
        headers = {**(headers or server.headers), "content-type": "application/json"}
    return httpx.post(server.url + path, headers=headers or server.headers, timeout=60, **kw)


def _assert_error(r: httpx.Response, status: int, param: str) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and err["message"]


def _still_serves(server) -> None:
    r = _post(server, "/v1/completions", json={"model": server.model_name, **OK_COMPLETION})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("length", "stop")


@pytest.mark.parametrize("change,status,param", COMPLETION_CASES, ids=[c[2] + str(i) for i, c in enumerate(COMPLETION_CASES)])
def test_bad_completion_fields(tiny_server, change, status, param):
    body = {"model": tiny_server.model_name, **OK_COMPLETION, **change}
    _assert_error(_post(tiny_server, "/v1/completions", json=body), status, param)
    _still_serves(tiny_server)


@pytest.mark.parametrize("change,status,param", CHAT_CASES, ids=[c[2] + str(i) for i, c in enumerate(CHAT_CASES)])
def test_bad_chat_fields(tiny_server, change, status, param):
    body = {"model": tiny_server.model_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **change}
    _assert_error(_post(tiny_server, "/v1/chat/completions", json=body), status, param)
    _still_serves(tiny_server)


@pytest.mark.parametrize("content,ctype,status", [
    ('{"prompt": "x"}', "text/plain", 415),
    ("[1, 2, 3]", "application/json", 400),
    ('"just a string"', "application/json", 400),
    ("{not json", "application/json", 400),
])
def test_bodies_that_are_not_json_objects(tiny_server, content, ctype, status):
    for path in ("/v1/completions", "/v1/chat/completions", "/generate"):
        r = _post(tiny_server, path, content=content, headers={**tiny_server.headers, "content-type": ctype})
        assert r.status_code == status, (path, r.text)
        assert r.json()["error"]["message"]
    _still_serves(tiny_server)


@pytest.mark.parametrize("body,param", [
    ({"input_ids": [999999]}, "input_ids"),
    ({"input_ids": []}, "input_ids"),
    ({"text": "x", "input_ids": [1]}, "text"),
    ({"text": "x", "sampling_params": {"bogus": 1}}, "sampling_params.bogus"),
    ({"text": "x", "sampling_params": {"n": 9}}, "sampling_params.n"),
    ({"text": "x", "sampling_params": {"stop_token_ids": [10**7]}}, "sampling_params.stop_token_ids"),
    ({"text": "x", "sampling_params": {"max_new_tokens": 10**6}}, "sampling_params.max_new_tokens"),
    ({"text": "x", "sampling_params": {"max_tokens": 10**6}}, "sampling_params.max_tokens"),
    ({"text": "x", "sampling_params": {"stop": 5}}, "sampling_params.stop"),
    ({"text": "x", "sampling_params": {"stop_token_ids": 5}}, "sampling_params.stop_token_ids"),
    ({"text": "x", "sampling_params": {"skip_special_tokens": "no"}}, "sampling_params.skip_special_tokens"),
    ({"text": "x", "sampling_params": {"seed": 2**64}}, "sampling_params.seed"),
    ({"text": "x", "sampling_params": {"top_k": 2**64}}, "sampling_params.top_k"),
    ({"text": "x", "sampling_params": {"temperature": float("inf")}}, "sampling_params.temperature"),
    ({"text": "x", "sampling_params": {"repetition_penalty": float("inf")}}, "sampling_params.repetition_penalty"),
    ({"text": "x", "sampling_params": {"logit_bias": {"1": float("nan")}}}, "sampling_params.logit_bias.1"),
    ({"text": "x", "sampling_params": {"min_tokens": "3"}}, "sampling_params.min_tokens"),
    ({"text": "x", "sampling_params": []}, "sampling_params"),
    ({"text": "\ud800"}, "text"),
    ({"text": 5}, "text"),
    ({"input_ids": [2**64]}, "input_ids.0"),
    ({"input_ids": [1, True]}, "input_ids.1"),
    ({"text": "x", "sampling_params": {"max_new_tokens": 4, "max_tokens": 8}}, "sampling_params.max_new_tokens"),
    ({"text": "x", "sampling_params": {"logprobs": 1}}, "sampling_params.logprobs"),
    ({"text": "x", "sampling_params": {"prompt_logprobs": 1}}, "sampling_params.prompt_logprobs"),
    ({"text": "x", "sampling_params": {"temperature": 1e300}}, "sampling_params.temperature"),
    ({"text": "x", "sampling_params": {"repetition_penalty": 1e-300}}, "sampling_params.repetition_penalty"),
    ({"text": "x", "sampling_params": {"stop_token_ids": list(range(1025))}}, "sampling_params.stop_token_ids"),
])
def test_bad_native_generate(tiny_server, body, param):
    _assert_error(_post(tiny_server, "/generate", json=body), 400, param)
    _still_serves(tiny_server)


@pytest.mark.parametrize("depth", [60, 900, 1000, 100_000])
def test_deeply_nested_bodies(tiny_server, depth):
    nested = "[" * depth + "]" * depth
    for path, field in (("/v1/completions", "prompt"), ("/v1/chat/completions", "messages"), ("/generate", "text")):
        r = _post(tiny_server, path, content=f'{{"{field}": {nested}}}',
                  headers={**tiny_server.headers, "content-type": "application/json"})
        assert r.status_code == 400, (path, depth, r.text)
        assert r.json()["error"]["message"]
    _still_serves(tiny_server)


def test_native_params_cover_sampling_params():
    """Every SamplingParams field can be set through /generate, and only those (plus the alias)."""
    from engine.core.sampling_params import SamplingParams
    from engine.server.native_routes import NativeSamplingParams

    clients = set(SamplingParams.__dataclass_fields__) - {"kv_transfer"}  # that one: the bootstrap fields (PD)
    assert set(NativeSamplingParams.model_fields) == clients | {"max_new_tokens"}


@pytest.mark.parametrize("path,change", [
    ("/v1/chat/completions", {"response_format": {"type": "text"}, "tool_choice": "none", "tools": []}),
    ("/v1/completions", {"best_of": 1, "suffix": ""}),
    ("/v1/completions", {"temperature": 1e30, "repetition_penalty": 1e-5, "logit_bias": {"1": -100}}),
])
def test_no_op_forms_of_unsupported_fields_are_accepted(tiny_server, path, change):
    base = ({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "def f(x):"})
    r = _post(tiny_server, path, json={"model": tiny_server.model_name, **base, "max_tokens": 2, **change})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("raw", [
    b'{"prompt": "\xed\xa0\x80", "max_tokens": 2}',  # a surrogate spelled in (not strictly UTF-8) bytes
    '{"prompt": "\\ud800", "max_tokens": 2}'.encode("utf-16"),  # an escaped one, in a UTF-16 body
    '{"prompt": "hi", "max_tokens": 2}'.encode("utf-32"),
    b'{"prompt": "\xff", "max_tokens": 2}',
], ids=["utf8-surrogate", "utf16-escape", "utf32", "bad-utf8"])
def test_bodies_that_are_not_utf8(tiny_server, raw):
    for path in ("/v1/completions", "/generate"):
        r = _post(tiny_server, path, content=raw, headers={**tiny_server.headers, "content-type": "application/json"})
        assert r.status_code == 400, (path, r.text)
    _still_serves(tiny_server)
