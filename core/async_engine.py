"""An asyncio front for the engine: the engine loop runs in its own thread; callers stream.

Commands (add, abort) cross into the engine thread through a queue and are applied between
steps, so the engine itself stays single-threaded. Outputs come back per request on an
``asyncio.Queue`` fed with ``call_soon_threadsafe``; a caller that stops iterating aborts.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import AsyncIterator

from .engine import LLMEngine
from .errors import EngineDeadError
from .outputs import RequestOutput
from .sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class AsyncLLM:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str) -> AsyncIterator[RequestOutput]:
        """Stream cumulative outputs of one request until it finishes. Validation errors raise here."""
        if not self.alive:
            raise EngineDeadError("the engine loop is not running")
        loop = asyncio.get_running_loop()
        stream: asyncio.Queue = asyncio.Queue()
        done = threading.Event()
        reply: list[BaseException | None] = [None]
        with self._lock:
            self._streams[request_id] = (loop, stream)
        self._commands.put(("add", request_id, prompt, params, done, reply))
        await asyncio.to_thread(done.wait)
        if reply[0] is not None:
            with self._lock:
                self._streams.pop(request_id, None)
            raise reply[0]
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def shutdown(self) -> None:
        self._stop.set()
        self._commands.put(("wake",))
        self._thread.join(timeout=10)

    def _deliver(self, out: RequestOutput | BaseException, request_id: str) -> None:
        with self._lock:
            target = self._streams.get(request_id)
        if target is not None:
            loop, stream = target
            loop.call_soon_threadsafe(stream.put_nowait, out)

    def _apply(self, cmd: tuple) -> None:
        if cmd[0] == "add":
            _, rid, prompt, params, done, reply = cmd
            try:
                self.engine.add_request(rid, prompt, params)
            except Exception as exc:
                reply[0] = exc
            done.set()
        elif cmd[0] == "abort":
            out = self.engine.abort_request(cmd[1])
            if out is not None:
                self._deliver(out, cmd[1])

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                block = not self.engine.has_unfinished_requests()
                try:
                    cmd = self._commands.get(timeout=0.1) if block else self._commands.get_nowait()
                    self._apply(cmd)
                    while True:
                        self._apply(self._commands.get_nowait())
                except queue.Empty:
                    pass
                for out in self.engine.step():
                    self._deliver(out, out.request_id)
        except BaseException as exc:  # the engine is dead: every waiting caller must hear it
            logger.exception("engine loop died")
            self.error = exc
            with self._lock:
                targets = list(self._streams.items())
            for rid, (loop, stream) in targets:
                loop.call_soon_threadsafe(stream.put_nowait, EngineDeadError(f"engine loop died: {exc}"))
