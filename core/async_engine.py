"""``AsyncLLM``: the asyncio API over an in-process core, through the shared front (core/front.py).

The core runs in its own thread; commands (add, abort, finish) cross into it through a queue and
are applied between steps, so the core stays single-threaded. Its typed outputs are read into
cumulative ``RequestOutput``s by the same ``RequestState`` the server uses; a caller that stops
iterating aborts its request.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import AsyncIterator

from .engine import EngineCore, LLMEngine
from .errors import EngineError
from .front import EngineFront
from .output_processor import RequestState
from .outputs import RequestOutput
from .sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class InProcFront(EngineFront):
    """The front's in-process transport: a thread steps the core and applies commands between steps."""

    def __init__(self, core: EngineCore) -> None:
        if isinstance(core, LLMEngine):
            raise TypeError("InProcFront drives an EngineCore; an LLMEngine reads its own outputs")
        super().__init__()
        self.core = core
        self._commands: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    async def _add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._commands.put(("add", request_id, prompt_token_ids, params))

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def finish_sequence(self, request_id: str, index: int, stop: str) -> None:
        self._commands.put(("finish", request_id, index, stop))

    def shutdown(self) -> None:
        self._stop.set()
        self._commands.put(("wake",))
        self._thread.join(timeout=10)

    def _apply(self, cmd: tuple) -> None:
        if cmd[0] == "add":
            _, rid, ids, params = cmd
            try:
                self.core.add_request(rid, ids, params)
            except EngineError as exc:
                self._deliver(rid, exc)
            return
        if cmd[0] == "abort":
            out = self.core.abort_request(cmd[1])
        elif cmd[0] == "finish":
            out = self.core.finish_sequence(*cmd[1:])
        else:
            return
        if out is not None:
            self._deliver(out.request_id, out)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                block = not self.core.has_unfinished_requests()
                try:
                    self._apply(self._commands.get(timeout=0.1) if block else self._commands.get_nowait())
                    while True:
                        self._apply(self._commands.get_nowait())
                except queue.Empty:
                    pass
                for out in self.core.step_outputs():
                    self._deliver(out.request_id, out)
        except BaseException as exc:  # the engine is dead: every waiting caller must hear it
            logger.exception("engine loop died")
            self._fail_all(f"the engine loop died: {exc}")


class AsyncLLM:
    """Stream cumulative ``RequestOutput``s of requests to an in-process core."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.front = InProcFront(core)

    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs of one request until it finishes; a refusal raises its ``EngineError``."""
        ids = self.core.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        await asyncio.to_thread(self.core.check_grammar, params)  # a grammar that fails is refused here
        state = RequestState(request_id, self.core.tokenizer, ids, params, prompt if isinstance(prompt, str) else None)
        async for out in self.front.generate(request_id, ids, params):
            updates = state.apply(out)
            for u in updates:
                if u.stop_string:
                    self.front.finish_sequence(request_id, u.completion.index, u.completion.stop_reason)
            if updates or state.finished:
                yield state.output()
            if state.finished:
                return

    def shutdown(self) -> None:
        self.front.shutdown()
