"""The API process's handle on the engine process: start it, stream its outputs, watch it die.

One reader task drains the engine's socket into a queue per request, so the engine never waits
on a slow client: a client that stops reading only grows its own queue. A monitor task notices a
dead engine process (exit, or a ``Failed`` message) within a fraction of a second; every waiting
request then fails with ``EngineDeadError`` and ``on_death`` runs. An engine that says nothing for
``SILENCE_S`` (stopped, or its loop stalled: see liveness.py) is not healthy until it speaks again.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from typing import Callable

import msgspec
import zmq
import zmq.asyncio

from ..core.config import EngineConfig
from ..core.errors import EngineDeadError, rebuild
from ..core.front import EngineFront
from ..core.sampling_params import SamplingParams
from . import wire
from .liveness import DEFAULT_STALL_S, SILENCE_S

logger = logging.getLogger(__name__)

MONITOR_S = 0.2


class EngineClient(EngineFront):
    """The front's transport over IPC to an engine process (core/front.py has the streaming)."""

    def __init__(self, config: EngineConfig, log_level: str = "INFO",
                 on_death: Callable[[str], None] | None = None, stall_timeout: float = DEFAULT_STALL_S) -> None:
        super().__init__()
        self.config = config
        self.log_level = log_level
        self.stall_timeout = stall_timeout
        self.on_death = on_death
        self.info: wire.Ready | None = None
        self.stats = wire.Stats()
        self._proc: subprocess.Popen | None = None
        self._dir: str | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._tasks: list[asyncio.Task] = []
        self._last_beat = 0.0
        self._storage: dict[str, asyncio.Future] = {}  # attach/detach commands awaiting the engine's answer

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self, timeout: float | None = None) -> wire.Ready:
        """Spawn the engine process and wait until its model is loaded."""
        self._dir = tempfile.mkdtemp(prefix="engine-ipc-")  # 0700: only this user reaches the sockets
        self._ctx = zmq.asyncio.Context()
        self._push, self._pull = self._ctx.socket(zmq.PUSH), self._ctx.socket(zmq.PULL)
        self._push.setsockopt(zmq.LINGER, 0)
        to_engine, from_engine = f"ipc://{self._dir}/requests", f"ipc://{self._dir}/outputs"
        self._push.bind(to_engine)
        self._pull.bind(from_engine)
        cmd = [sys.executable, "-m", "engine.server.engine_process", "--input", to_engine, "--output", from_engine,
               "--ipc-dir", self._dir, "--stall-timeout", str(self.stall_timeout), "--log-level", self.log_level]
        # its own session: signals to the server's process group (Ctrl-C, kill -TERM -PGID) are the
        # API process's to handle, which drains and then stops the engine by message
        self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, start_new_session=True)
        self._proc.stdin.write(json.dumps(asdict(self.config)).encode())
        self._proc.stdin.close()
        logger.info("engine process %d started; loading %s", self._proc.pid, self.config.model)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._proc.poll() is not None:
                raise EngineDeadError(f"the engine process exited with status {self._proc.returncode} "
                                      "while starting (its log above says why)")
            if deadline is not None and time.monotonic() > deadline:
                raise EngineDeadError(f"the engine did not become ready within {timeout} s")
            if await self._pull.poll(int(MONITOR_S * 1000)):
                msg = wire.from_engine_decoder.decode(await self._pull.recv())
                if isinstance(msg, wire.Failed):
                    raise EngineDeadError(f"the engine failed to start: {msg.message}")
                if isinstance(msg, wire.Ready):
                    break
        self.info = msg
        self._last_beat = time.monotonic()
        self._tasks = [asyncio.create_task(self._read()), asyncio.create_task(self._monitor())]
        return msg

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def healthy(self) -> bool:
        return self.unhealthy_reason is None

    @property
    def unhealthy_reason(self) -> str | None:
        if self.info is None:
            return "starting"
        if self.dead_reason is not None:
            return self.dead_reason
        silent = time.monotonic() - self._last_beat
        if silent >= SILENCE_S:
            return f"the engine has said nothing for {silent:.1f} s (stopped, or its loop is stalled)"
        return None

    async def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the engine process, reap it, and remove the sockets' directory."""
        for t in self._tasks:
            t.cancel()
        if self._proc is not None and self._proc.poll() is None:
            try:
                self._push.send(wire.encoder.encode(wire.Shutdown()), flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            try:
                await asyncio.to_thread(self._proc.wait, timeout)
            except subprocess.TimeoutExpired:
                logger.warning("engine process %d did not stop in %.0f s; killing it", self._proc.pid, timeout)
                self._proc.kill()
                await asyncio.to_thread(self._proc.wait)
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)

    # -- requests -----------------------------------------------------------------------------

    async def _add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        await self._push.send(wire.encoder.encode(wire.AddRequest(request_id, prompt_token_ids,
                                                                  wire.engine_params(params))))

    def abort(self, request_id: str) -> None:
        self._send_nowait(wire.AbortRequest(request_id))

    def finish_sequence(self, request_id: str, index: int, stop: str) -> None:
        self._send_nowait(wire.FinishSequence(request_id, index, stop))

    def abort_all(self) -> None:
        for rid in self.active:
            self.abort(rid)

    async def storage(self, msg: wire.AttachStorage | wire.DetachStorage) -> str | None:
        """Have the engine attach or detach its storage tier between steps; the tier attached now.
        Raises the engine's refusal (``InvalidRequest`` naming the field) or ``EngineDeadError``."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        done = asyncio.get_running_loop().create_future()
        self._storage[msg.admin_id] = done
        try:
            await self._push.send(wire.encoder.encode(msg))
            answer: wire.StorageDone = await done
        finally:
            self._storage.pop(msg.admin_id, None)
        if answer.code is not None:
            raise rebuild(answer.code, answer.detail, answer.field)
        return answer.backend

    def _send_nowait(self, msg) -> None:
        try:
            self._push.send(wire.encoder.encode(msg), flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            logger.warning("could not send %s to the engine: %s", type(msg).__name__, exc)

    # -- background tasks ---------------------------------------------------------------------

    async def _read(self) -> None:
        while True:
            raw = await self._pull.recv()
            try:
                msg = wire.from_engine_decoder.decode(raw)
            except msgspec.DecodeError as exc:
                logger.error("dropped a malformed message from the engine: %s", exc)
                continue
            self._last_beat = time.monotonic()  # any word from the engine says it is alive
            if isinstance(msg, wire.Outputs):
                self.stats = msg.stats
                for out in msg.deltas:
                    self._deliver(out.request_id, out)
            elif isinstance(msg, wire.Heartbeat):
                self.stats = msg.stats
            elif isinstance(msg, wire.Rejected):
                self._deliver(msg.request_id, rebuild(msg.code, msg.detail, msg.field))
            elif isinstance(msg, wire.StorageDone):
                if self.stats.hicache is not None:  # until the next stats say so
                    self.stats.hicache.storage_backend = msg.backend
                done = self._storage.get(msg.admin_id)
                if done is not None and not done.done():
                    done.set_result(msg)
            elif isinstance(msg, wire.Failed):
                self._died(f"the engine loop died: {msg.message}")

    async def _monitor(self) -> None:
        while self.dead_reason is None:
            code = self._proc.poll()
            if code is not None:
                self._died(f"the engine process exited with status {code}")
                return
            await asyncio.sleep(MONITOR_S)

    def _died(self, reason: str) -> None:
        if self.dead_reason is not None:
            return
        logger.error("%s; failing %d waiting requests", reason, self._fail_all(reason))
        for done in self._storage.values():
            if not done.done():
                done.set_exception(EngineDeadError(reason))
        if self.on_death is not None:
            self.on_death(reason)
