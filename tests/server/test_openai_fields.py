"""Every field of OpenAI's chat and completions requests is honoured or refused by name: none is
unknown to the request models, and each one this server does not do is a 400 naming it unless its
value asks for nothing."""

from __future__ import annotations

import random
import string

import httpx
import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from engine.server.protocol import ChatCompletionRequest, CompletionRequest
from engine.server.unsupported import CHAT_UNSUPPORTED


def _declared(model) -> set[str]:
    return {f.alias or name for name, f in model.model_fields.items()}


@pytest.mark.parametrize("params, model", [(chat_create_params.CompletionCreateParamsBase, ChatCompletionRequest),
                                           (completion_create_params.CompletionCreateParamsBase, CompletionRequest)])
def test_every_openai_field_is_declared(params, model):
    assert set(params.__annotations__) - _declared(model) == set()


def _chat(server, **fields) -> httpx.Response:
    body = {"model": server.model_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, **fields}
    return httpx.post(server.url + "/v1/chat/completions", headers=server.headers, json=body, timeout=60)


@pytest.mark.parametrize("field", sorted(CHAT_UNSUPPORTED))
def test_an_unsupported_field_is_refused_by_name_unless_it_asks_for_nothing(tiny_server, field, seed):
    asked = "".join(random.choice(string.ascii_lowercase) for _ in range(8))
    for value in (asked, {asked: 1}, [asked], True):
        r = _chat(tiny_server, **{field: value})
        assert r.status_code == 400, (value, r.text)
        assert r.json()["error"]["param"] == field and CHAT_UNSUPPORTED[field][1] in r.json()["error"]["message"]
    for value in CHAT_UNSUPPORTED[field][0]:
        assert _chat(tiny_server, **{field: value}).status_code == 200, value
