"""The gate every request passes before any route runs (plain ASGI, so streaming is untouched).

In order: the API key on every route but /health, compared in constant time; then, for the
generation routes, 503 while the server drains or the engine is not serving; the body, read whole
against ``--max-request-body`` (413) and ``--body-timeout`` (408: a client that sends headers and
then trickles or stalls its body is cut off, not waited on); only then the concurrency cap (429 at
once past ``--max-concurrent-requests``) and the in-flight count. A request counts as in flight
from the moment its body is in, so idle or slow uploads cannot fill the cap; the route gets the
body replayed.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from dataclasses import dataclass, field

from .errors import APIError, error_body
from .openai_serving import Serving
from .worker_info import WorkerInfo

# the routes that read a body and need the engine's tokenizer (tokenize_routes.py counts)
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/generate", "/tokenize", "/detokenize"})
PUBLIC_PATHS = frozenset({"/health"})


@dataclass
class ServerState:
    api_key: str | None = None
    max_concurrent_requests: int | None = None
    max_body_bytes: int = 32 * 2**20
    body_timeout: float = 30.0
    serving: Serving | None = None
    worker: WorkerInfo | None = None  # what a gateway asks of this worker (worker_info.py)
    draining: bool = False
    in_flight: int = 0
    started: float = field(default_factory=time.time)

    @property
    def serving_now(self) -> bool:
        return self.serving is not None and self.serving.client.healthy and not self.draining


def _authorized(headers: dict[bytes, bytes], key: bytes) -> bool:
    auth = headers.get(b"authorization", b"")
    given = auth[7:].strip() if auth[:7].lower() == b"bearer " else headers.get(b"x-api-key", b"")
    return hmac.compare_digest(given, key)


async def _send_error(send, err: APIError, headers: list[tuple[bytes, bytes]] = ()) -> None:
    body = json.dumps(error_body(err)).encode()
    await send({"type": "http.response.start", "status": err.status_code,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


class _Disconnected(Exception):
    """The client left while sending its body."""


def _unavailable(st: ServerState) -> APIError:
    why = "the server is shutting down" if st.draining else "the engine is not serving"
    return APIError(503, why, "service_unavailable", None, "unavailable")


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the body is larger than {limit} bytes", "invalid_request_error", None, "body_too_large")


async def _read_body(receive, declared: bytes | None, limit: int) -> bytes:
    """The body, refused as soon as it passes ``limit`` (declared or received), never read whole first."""
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    parts, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _Disconnected
        part = message.get("body", b"")
        size += len(part)
        if size > limit:
            raise _too_large(limit)
        parts.append(part)
        if not message.get("more_body", False):
            return b"".join(parts)


def _replaying(body: bytes, receive):
    """A receive that gives the body read already, then passes on (to hear a disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay():
        return pending.pop() if pending else await receive()
    return replay


class Gate:
    def __init__(self, app, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        st, path = self.state, scope["path"]
        headers = dict(scope["headers"])
        if st.api_key and path not in PUBLIC_PATHS and not _authorized(headers, st.api_key.encode()):
            return await _send_error(send, APIError(401, "a valid API key is required (Authorization: Bearer KEY)",
                                                    "authentication_error", None, "invalid_api_key"),
                                     [(b"www-authenticate", b"Bearer")])
        if path not in GENERATION_PATHS:
            return await self.app(scope, receive, send)
        if not st.serving_now:
            return await _send_error(send, _unavailable(st))
        try:
            body = await asyncio.wait_for(_read_body(receive, headers.get(b"content-length"), st.max_body_bytes),
                                          st.body_timeout)
        except _Disconnected:
            return
        except APIError as err:
            return await _send_error(send, err, [(b"connection", b"close")])
        except asyncio.TimeoutError:
            return await _send_error(send, APIError(
                408, f"the body did not arrive within {st.body_timeout:g} s", "invalid_request_error", None,
                "request_timeout"), [(b"connection", b"close")])
        if not st.serving_now:  # the server began to drain, or lost its engine, while the body came in
            return await _send_error(send, _unavailable(st))
        if st.max_concurrent_requests and st.in_flight >= st.max_concurrent_requests:
            st.serving.metrics.rejected_overload += 1
            return await _send_error(send, APIError(
                429, f"the server is at its limit of {st.max_concurrent_requests} concurrent requests; retry later",
                "rate_limit_error", None, "too_many_requests"), [(b"retry-after", b"1")])
        st.in_flight += 1
        try:
            await self.app(scope, _replaying(body, receive), send)
        finally:
            st.in_flight -= 1
