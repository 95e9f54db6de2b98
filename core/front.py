"""One async front over an engine core, whatever carries it to the core.

A caller streams one request's typed outputs (``EngineCoreOutput``) until it finishes; leaving
early aborts it in the core; a refusal arrives as the core's ``EngineError``, and a dead engine
fails every waiting stream with ``EngineDeadError``. Two transports implement it, as vLLM's
in-process and multiprocess core clients share one interface: a thread driving an in-process core
(core/async_engine.py, behind ``AsyncLLM``) and an engine process over IPC (server/engine_client.py).
"""

from __future__ import annotations

import abc
import asyncio
import threading
from typing import AsyncIterator

from .errors import EngineDeadError, EngineError, InvalidRequest
from .outputs import EngineCoreOutput
from .sampling_params import SamplingParams


class EngineFront(abc.ABC):
    def __init__(self) -> None:
        self.dead_reason: str | None = None
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()  # a transport may deliver from its own thread

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[EngineCoreOutput]:
        """Stream one request's outputs until it finishes; leaving early aborts it in the core."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if request_id in self._streams:
                raise InvalidRequest("request_id", f"{request_id!r} is in use")
            self._streams[request_id] = (asyncio.get_running_loop(), queue)
        finished = False
        try:
            await self._add(request_id, prompt_token_ids, params)
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True  # the core holds nothing for it any more
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished and self.dead_reason is None:
                self.abort(request_id)

    @abc.abstractmethod
    async def _add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Hand the request to the core; its outputs or its refusal come through ``_deliver``."""

    @abc.abstractmethod
    def abort(self, request_id: str) -> None:
        """End a request in the core (its last output, if anyone still listens, comes as usual)."""

    @abc.abstractmethod
    def finish_sequence(self, request_id: str, index: int, stop: str) -> None:
        """End one completion that its reader saw reach a stop string."""

    @property
    def active(self) -> list[str]:
        with self._lock:
            return list(self._streams)

    def _deliver(self, request_id: str, item: EngineCoreOutput | EngineError) -> None:
        """Hand an output or a refusal to the request's stream; safe from any thread."""
        with self._lock:
            target = self._streams.get(request_id)
        if target is not None:
            loop, queue = target
            loop.call_soon_threadsafe(queue.put_nowait, item)

    def _fail_all(self, reason: str) -> int:
        """The engine is gone: every waiting stream hears it. Returns how many were waiting."""
        self.dead_reason = reason
        with self._lock:
            targets = list(self._streams.values())
        for loop, queue in targets:
            loop.call_soon_threadsafe(queue.put_nowait, EngineDeadError(reason))
        return len(targets)
