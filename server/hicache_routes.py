"""The storage tier (L3) attached and detached at run time, under SGLang's route names.

``PUT /hicache/storage-backend`` attaches one (``hicache_storage_backend`` and, optionally, the
directory and prefetch settings, named as the flags are; the others keep the start-up flags'),
``DELETE`` detaches it, ``GET`` says which is attached. The engine applies a change between two
steps, so requests in flight go on (SGLang asks for an idle server; this does not). Behind the API
key like every route; a bad field is a 400 naming it, and the tier attached before stays.
"""

from __future__ import annotations

import uuid
from types import SimpleNamespace
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ..core.config import HICACHE_PREFETCH_POLICIES
from ..core.errors import EngineError
from ..core.tiers.file import file_reasons
from . import wire
from .errors import engine_error, invalid
from .gate import ServerState
from .openai_serving import Serving
from .protocol import Int64, StrictRequest

PATH = "/hicache/storage-backend"


class AttachStorageRequest(StrictRequest):
    hicache_storage_backend: str
    hicache_storage_dir: str | None = None
    hicache_storage_prefetch_policy: Literal[HICACHE_PREFETCH_POLICIES] | None = None  # type: ignore[valid-type]
    hicache_storage_prefetch_threshold: Int64 | None = None
    hicache_storage_max_size: float | None = None


def _answer(backend: str | None) -> JSONResponse:
    return JSONResponse({"hicache_storage_backend": backend})


async def _command(s: Serving, msg) -> Response:
    try:
        return _answer(await s.client.storage(msg))
    except EngineError as exc:
        raise engine_error(exc) from None


async def attach_storage(s: Serving, req: AttachStorageRequest, _: Request) -> Response:
    if not req.hicache_storage_backend:
        raise invalid("hicache_storage_backend", "name a storage backend (file, or a plugin's)")
    if req.hicache_storage_dir is not None:
        reasons = file_reasons(SimpleNamespace(engine_config=SimpleNamespace(hicache_storage_dir=req.hicache_storage_dir)))
        if reasons:
            raise invalid("hicache_storage_dir", "; ".join(reasons))
    return await _command(s, wire.AttachStorage(uuid.uuid4().hex, req.hicache_storage_backend, req.hicache_storage_dir,
                                                req.hicache_storage_prefetch_policy,
                                                req.hicache_storage_prefetch_threshold, req.hicache_storage_max_size))


def add_hicache_routes(app: FastAPI, state: ServerState) -> None:
    """``GET`` and ``DELETE`` (``PUT`` takes a body: the app's parsing route adds it)."""

    @app.get(PATH)
    async def storage_backend() -> Response:
        h = state.serving.client.stats.hicache
        return _answer(h.storage_backend if h is not None else None)

    @app.delete(PATH)
    async def detach_storage() -> Response:
        return await _command(state.serving, wire.DetachStorage(uuid.uuid4().hex))
