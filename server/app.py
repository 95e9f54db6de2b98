"""The FastAPI application: routes, and the gate every request passes first.

The gate (plain ASGI, so streaming is untouched) checks the API key on every route but /health
in constant time, answers 503 while the server drains or the engine is down, and answers 429 at
once past ``--max-concurrent-requests`` instead of letting requests queue into timeouts. Bodies
are read and validated by hand so every refusal is an OpenAI-style 4xx naming the field.
"""

from __future__ import annotations

import hmac
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import pydantic
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from .errors import APIError, error_body, invalid
from .native_routes import GenerateRequest, generate
from .openai_serving import Serving, create_chat_completion, create_completion
from .protocol import ChatCompletionRequest, CompletionRequest, pydantic_error_to_api
from .request_body import parse_json_object

logger = logging.getLogger(__name__)

GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/generate"})
PUBLIC_PATHS = frozenset({"/health"})


@dataclass
class ServerState:
    api_key: str | None = None
    max_concurrent_requests: int | None = None
    max_body_bytes: int = 32 * 2**20
    serving: Serving | None = None
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


class Gate:
    """Auth, drain, engine health and the concurrency cap, before any route runs."""

    def __init__(self, app, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        st, path = self.state, scope["path"]
        if st.api_key and path not in PUBLIC_PATHS and not _authorized(dict(scope["headers"]), st.api_key.encode()):
            return await _send_error(send, APIError(401, "a valid API key is required (Authorization: Bearer KEY)",
                                                    "authentication_error", None, "invalid_api_key"),
                                     [(b"www-authenticate", b"Bearer")])
        if path not in GENERATION_PATHS:
            return await self.app(scope, receive, send)
        if not st.serving_now:
            why = "the server is shutting down" if st.draining else "the engine is not serving"
            return await _send_error(send, APIError(503, why, "service_unavailable", None, "unavailable"))
        if st.max_concurrent_requests and st.in_flight >= st.max_concurrent_requests:
            st.serving.metrics.rejected_overload += 1
            return await _send_error(send, APIError(
                429, f"the server is at its limit of {st.max_concurrent_requests} concurrent requests; retry later",
                "rate_limit_error", None, "too_many_requests"), [(b"retry-after", b"1")])
        st.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            st.in_flight -= 1


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the body is larger than {limit} bytes", "invalid_request_error", None, "body_too_large")


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused as soon as it passes ``limit`` (declared or streamed), never read whole first."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise _too_large(limit)
        parts.append(part)
    return b"".join(parts)


async def _json_object(request: Request, limit: int) -> dict:
    return parse_json_object(await _read_body(request, limit), request.headers.get("content-type", ""))


def _parse(model: type[pydantic.BaseModel], body: dict):
    try:
        return model.model_validate(body)
    except pydantic.ValidationError as exc:
        raise pydantic_error_to_api(exc) from None


def build_app(state: ServerState, lifespan=None) -> Callable:
    app = FastAPI(title="engine", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(error_body(exc), status_code=exc.status_code)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = APIError(exc.status_code, str(exc.detail), "invalid_request_error" if exc.status_code < 500 else "server_error")
        return JSONResponse(error_body(err), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(error_body(invalid(None, str(exc))), status_code=400)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error")
        return JSONResponse(error_body(APIError(500, f"internal error: {type(exc).__name__}", "server_error")),
                            status_code=500)

    def route(handler: Callable[[Serving, dict, Request], Awaitable[Response]]):
        async def endpoint(request: Request) -> Response:
            return await handler(state.serving, await _json_object(request, state.max_body_bytes), request)
        return endpoint

    app.add_api_route("/v1/completions", route(lambda s, b, r: create_completion(s, _parse(CompletionRequest, b), r)),
                      methods=["POST"])
    app.add_api_route("/v1/chat/completions",
                      route(lambda s, b, r: create_chat_completion(s, _parse(ChatCompletionRequest, b), r)),
                      methods=["POST"])
    app.add_api_route("/generate", route(lambda s, b, r: generate(s, _parse(GenerateRequest, b), r)), methods=["POST"])

    @app.get("/health")
    async def health() -> Response:
        if state.serving_now:
            return Response(status_code=200)
        client = state.serving.client if state.serving else None
        why = "draining" if state.draining else (client.unhealthy_reason if client else "starting")
        return JSONResponse(error_body(APIError(503, f"not serving: {why}", "service_unavailable")), status_code=503)

    @app.get("/v1/models")
    async def models() -> dict:
        s = state.serving
        return {"object": "list", "data": [{"id": s.model_name, "object": "model", "created": int(state.started),
                                            "owned_by": "engine", "root": s.model_name,
                                            "max_model_len": s.max_model_len, "vocab_size": s.vocab_size}]}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        s = state.serving
        return PlainTextResponse(s.metrics.render(s.client.stats, state.in_flight),
                                 media_type="text/plain; version=0.0.4")

    return Gate(app, state)
