"""/tokenize and /detokenize, shaped like vLLM's: behind the API key, bad input a 400 naming the field."""

from __future__ import annotations

import random

import httpx
import pytest

from engine.core.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3) -> Tokenizer:
    return Tokenizer.from_dir(tiny_qwen3)


def _post(server, route: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(server.url + route, json=body, headers=server.headers if headers is None else headers,
                      timeout=60)


def test_a_prompt_and_messages_tokenize_as_the_generation_routes_do(tiny_server, tokenizer, seed):
    rng = random.Random(seed)
    text = " ".join(rng.choice(["def", "return", "x", "(", "):", "print", "é", "\n"]) for _ in range(rng.randrange(1, 30)))
    r = _post(tiny_server, "/tokenize", {"model": tiny_server.model_name, "prompt": text, "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tokenizer.encode(text) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 512 and body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])
    back = _post(tiny_server, "/detokenize", {"model": tiny_server.model_name, "tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": text}

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": text}]
    r = _post(tiny_server, "/tokenize", {"messages": messages})
    assert r.status_code == 200, r.text
    chat = httpx.post(tiny_server.url + "/v1/chat/completions", headers=tiny_server.headers, timeout=60,
                      json={"messages": messages, "max_tokens": 1}).json()
    assert r.json()["count"] == chat["usage"]["prompt_tokens"] and r.json()["token_strs"] is None
    without = _post(tiny_server, "/tokenize", {"messages": messages, "add_generation_prompt": False}).json()
    assert without["count"] < r.json()["count"] and r.json()["tokens"][:without["count"]] == without["tokens"]


@pytest.mark.parametrize("route, body, field", [
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "a"}]}, None),
    ("/tokenize", {}, None),
    ("/tokenize", {"prompt": 3}, "prompt"),
    ("/tokenize", {"prompt": "a", "continue_final_message": True}, "continue_final_message"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "a"}]}, "messages.0.role"),
    ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": "1 2"}, "tokens"),
])
def test_bad_input_is_a_400_naming_the_field(tiny_server, route, body, field):
    r = _post(tiny_server, route, body)
    assert r.status_code == 400, r.text
    if field is not None:
        assert r.json()["error"]["param"] == field
    assert _post(tiny_server, "/tokenize", {"prompt": "still serving"}).status_code == 200


def test_the_routes_want_the_api_key_and_the_served_model(tiny_server):
    for route, body in (("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [1]})):
        assert _post(tiny_server, route, body, headers={}).status_code == 401
        r = _post(tiny_server, route, {**body, "model": "another"})
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"
