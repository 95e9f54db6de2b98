"""With an API key set, every route but /health wants it: none, a wrong one, the right one."""

from __future__ import annotations

import httpx
import pytest

from engine.server.gate import _authorized

ROUTES = [
    ("GET", "/v1/models", None),
    ("GET", "/metrics", None),
    ("GET", "/server_info", None),
    ("GET", "/get_server_info", None),
    ("GET", "/model_info", None),
    ("GET", "/get_model_info", None),
    ("GET", "/v1/loads", None),
    ("GET", "/hicache/storage-backend", None),
    ("DELETE", "/hicache/storage-backend", None),  # PUT: tests/server/test_hicache_admin.py
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 1}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}),
    ("POST", "/generate", {"text": "x", "sampling_params": {"max_tokens": 1}}),
]


@pytest.mark.parametrize("method,path,body", ROUTES, ids=[r[1] for r in ROUTES])
def test_every_route_wants_the_key(tiny_server, method, path, body):
    def call(headers):
        return httpx.request(method, tiny_server.url + path, json=body, headers=headers, timeout=60)

    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {tiny_server.api_key}x"},
                    {"X-Api-Key": "wrong"}, {"Authorization": tiny_server.api_key}):
        r = call(headers)
        assert r.status_code == 401, (headers, r.text)
        assert r.json()["error"]["type"] == "authentication_error"
    assert call({"Authorization": f"Bearer {tiny_server.api_key}"}).status_code == 200
    assert call({"X-Api-Key": tiny_server.api_key}).status_code == 200


def test_health_and_unknown_routes(tiny_server):
    assert httpx.get(tiny_server.url + "/health").status_code == 200
    assert httpx.get(tiny_server.url + "/no-such-route").status_code == 401  # no route is open by accident
    r = httpx.get(tiny_server.url + "/no-such-route", headers=tiny_server.headers)
    assert r.status_code == 404 and "error" in r.json()


def test_key_comparison():
    key = b"s3cret"
    assert _authorized({b"authorization": b"Bearer s3cret"}, key)
    assert _authorized({b"authorization": b"bearer  s3cret "}, key)
    assert _authorized({b"x-api-key": b"s3cret"}, key)
    assert not _authorized({b"authorization": b"Bearer s3cre"}, key)
    assert not _authorized({b"authorization": b"Basic s3cret"}, key)
    assert not _authorized({}, key)
