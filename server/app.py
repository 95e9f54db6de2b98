"""The FastAPI application: routes behind the gate (gate.py) every request passes first.

Bodies are parsed and validated by hand so every refusal is an OpenAI-style 4xx naming the field.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

import pydantic
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from .errors import APIError, error_body, invalid
from .gate import Gate, ServerState
from .hicache_routes import PATH as HICACHE_PATH, AttachStorageRequest, add_hicache_routes, attach_storage
from .native_routes import GenerateRequest, generate
from .openai_serving import Serving, create_chat_completion, create_completion
from .protocol import ChatCompletionRequest, CompletionRequest, pydantic_error_to_api
from .request_body import parse_json_object
from .tokenize_routes import DetokenizeRequest, TokenizeRequest, detokenize, tokenize
from .worker_info import add_worker_routes

logger = logging.getLogger(__name__)


INLINE_PARSE_BYTES = 1 << 16  # larger bodies are parsed and validated in a worker thread


def _parse(model: type[pydantic.BaseModel], raw: bytes, content_type: str):
    """The body as ``model``, or an APIError naming the field."""
    body = parse_json_object(raw, content_type)
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

    def route(model: type[pydantic.BaseModel], handler: Callable[[Serving, object, Request], Awaitable[Response]]):
        async def endpoint(request: Request) -> Response:
            raw, ctype = await request.body(), request.headers.get("content-type", "")
            if len(raw) < INLINE_PARSE_BYTES:
                parsed = _parse(model, raw, ctype)
            else:  # a 32 MiB body takes a while to parse: not on the loop every stream shares
                parsed = await asyncio.to_thread(_parse, model, raw, ctype)
            return await handler(state.serving, parsed, request)
        return endpoint

    app.add_api_route("/v1/completions", route(CompletionRequest, create_completion), methods=["POST"])
    app.add_api_route("/v1/chat/completions", route(ChatCompletionRequest, create_chat_completion), methods=["POST"])
    app.add_api_route("/generate", route(GenerateRequest, generate), methods=["POST"])
    app.add_api_route(HICACHE_PATH, route(AttachStorageRequest, attach_storage), methods=["PUT"])
    add_hicache_routes(app, state)
    app.add_api_route("/tokenize", route(TokenizeRequest, tokenize), methods=["POST"])
    app.add_api_route("/detokenize", route(DetokenizeRequest, detokenize), methods=["POST"])

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

    add_worker_routes(app, state)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        s = state.serving
        return PlainTextResponse(s.metrics.render(s.client.stats, state.in_flight),
                                 media_type="text/plain; version=0.0.4")

    return Gate(app, state)
