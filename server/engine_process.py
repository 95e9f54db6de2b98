"""The engine process: owns the device, runs the scheduler loop, talks msgpack over ZMQ.

Started by the API process as ``python -m engine.server.engine_process`` with the engine config
as JSON on stdin and two socket addresses the API process has bound. It sends ``Ready`` once the
model is loaded, then per step the core's typed outputs (token deltas) of the requests it changed, and a heartbeat
with the gauges while idle; a thread says ``Alive`` while the loop makes progress (liveness.py).
A dead loop says ``Failed``, stops its other tensor-parallel ranks (a rank that died
ends the loop) and exits non-zero; a vanished parent ends it too, and then it removes
the sockets' directory itself, so neither the engine nor its sockets outlive the server.

It runs in its own session (the API process starts it so): Ctrl-C in a terminal or a signal to the
server's process group reaches the API process only, which drains and then stops this process by
message. Signals are the parent's to handle.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import time

import msgspec
import zmq

from ..core.config import EngineConfig
from ..core.disagg import engine_class
from ..core.engine import EngineCore
from ..core.errors import EngineError, InvalidRequest
from ..core.outputs import EngineCoreOutput
from . import wire
from .liveness import DEFAULT_STALL_S, Liveness

logger = logging.getLogger("engine.server.engine_process")

HEARTBEAT_S = 0.5


def _stats(engine: EngineCore) -> wire.Stats:
    s = engine.stats()
    return wire.Stats(s.num_running, s.num_waiting, s.kv_usage, s.prefix_cache_queries, s.prefix_cache_hits,
                      s.num_preemptions, s.spec, s.hicache, s.kv_transfer)


class EngineLoop:
    def __init__(self, engine: EngineCore, pull: zmq.Socket, push: zmq.Socket, parent_pid: int,
                 liveness: Liveness) -> None:
        self.engine = engine
        self.pull = pull
        self.push = push
        self.parent_pid = parent_pid
        self.liveness = liveness
        self.orphaned = False
        self._stop = False
        self._pending: list[EngineCoreOutput] = []

    def _send(self, msg) -> None:
        self.push.send(wire.encoder.encode(msg), copy=False)

    def _report(self, out: EngineCoreOutput | None) -> None:
        if out is not None:
            self._pending.append(out)

    def _reject(self, request_id: str, exc: EngineError) -> None:
        self._send(wire.Rejected(request_id, exc.code.value, exc.detail, exc.field))

    def _apply(self, msg) -> None:
        e = self.engine
        if isinstance(msg, wire.AddRequest):
            try:
                e.add_request(msg.request_id, msg.prompt_token_ids, wire.sampling_params(msg.params))
            except EngineError as exc:
                self._reject(msg.request_id, exc)
        elif isinstance(msg, wire.AbortRequest):
            self._report(e.abort_request(msg.request_id))
        elif isinstance(msg, wire.FinishSequence):
            self._report(e.finish_sequence(msg.request_id, msg.index, msg.stop))
        elif isinstance(msg, (wire.AttachStorage, wire.DetachStorage)):
            self._send(self._storage(msg))
        elif isinstance(msg, wire.Shutdown):
            self._stop = True

    def _storage(self, msg: wire.AttachStorage | wire.DetachStorage) -> wire.StorageDone:
        """Attach or detach the storage tier here, between steps; the answer says what is attached now."""
        e = self.engine
        try:
            if isinstance(msg, wire.DetachStorage):
                e.detach_storage()
                return wire.StorageDone(msg.admin_id)
            return wire.StorageDone(msg.admin_id, e.attach_storage(msg.backend, msg.directory, msg.prefetch_policy,
                                                                   msg.prefetch_threshold, msg.max_size))
        except EngineError as exc:
            stats = e.kv_manager.hicache_stats()
            return wire.StorageDone(msg.admin_id, stats.storage_backend if stats else None, exc.code.value,
                                    exc.detail, exc.field)

    def _receive(self, timeout_ms: int) -> None:
        while self.pull.poll(timeout_ms):
            timeout_ms = 0
            raw = self.pull.recv(copy=False).buffer
            try:
                msg = wire.to_engine_decoder.decode(raw)
            except msgspec.DecodeError as exc:  # a bad message is dropped, never trusted
                self._malformed(raw, exc)
                continue
            self._apply(msg)

    def _malformed(self, raw, exc: msgspec.DecodeError) -> None:
        """Log it; a request that still says its id is refused, so its caller does not wait forever."""
        try:
            request_id = wire.envelope_decoder.decode(raw).request_id
        except msgspec.DecodeError:
            logger.error("dropped a malformed message: %s", exc)
            return
        logger.error("refused request %r: a malformed message: %s", request_id, exc)
        self._reject(request_id, InvalidRequest(None, f"malformed request: {exc}"))

    def run(self) -> None:
        last_beat = 0.0
        while not self._stop:
            self.liveness.iteration()
            self.engine.check_alive()  # a tensor-parallel rank that died ends the loop, busy or idle
            busy = self.engine.has_unfinished_requests()
            self._receive(0 if busy else int(HEARTBEAT_S * 1000))
            if self._stop:
                break
            if self.engine.has_unfinished_requests():
                self._pending += self.engine.step_outputs()
                for request_id, exc in self.engine.take_failures():
                    self._reject(request_id, exc)
            if self._pending:
                self._send(wire.Outputs(self._pending, _stats(self.engine)))
                self._pending = []
            now = time.monotonic()
            if now - last_beat >= HEARTBEAT_S:
                last_beat = now
                self._send(wire.Heartbeat(_stats(self.engine)))
                if os.getppid() != self.parent_pid:
                    logger.error("the API process is gone; stopping")
                    self.orphaned = True
                    return


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="engine process (started by `engine serve`)")
    p.add_argument("--input", required=True, help="ZMQ address to pull requests from")
    p.add_argument("--output", required=True, help="ZMQ address to push outputs to")
    p.add_argument("--ipc-dir", default=None, help="the sockets' directory, removed here if the API process is gone")
    p.add_argument("--stall-timeout", type=float, default=DEFAULT_STALL_S,
                   help="seconds one loop iteration may take before the engine stops saying it is alive")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s engine-process: %(message)s")
    parent = os.getppid()
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 2000)
    pull.connect(args.input)
    push.connect(args.output)
    engine = None
    try:
        config = EngineConfig(**json.loads(sys.stdin.read()))
        engine = engine_class(config)(config)
        push.send(wire.encoder.encode(wire.Ready(engine.max_model_len, engine.vocab_size, engine.kv_manager.num_pages,
                                                 config.page_size)))
        logger.info("serving: max_model_len %d, %d KV pages of %d tokens", engine.max_model_len,
                    engine.kv_manager.num_pages, config.page_size)
        with Liveness(ctx, args.output, args.stall_timeout) as liveness:
            loop = EngineLoop(engine, pull, push, parent, liveness)
            loop.run()
        engine.shutdown()
        if loop.orphaned and args.ipc_dir:
            shutil.rmtree(args.ipc_dir, ignore_errors=True)
    except BaseException as exc:
        logger.exception("engine loop died")
        push.send(wire.encoder.encode(wire.Failed(f"{type(exc).__name__}: {exc}")))
        push.close(linger=2000)
        if engine is not None:  # its other tensor-parallel ranks stopped and reaped here, not left to a
            engine.shutdown()  # finalizer that may run in a daemon thread cut off at exit
        return 1
    push.close()
    pull.close()
    ctx.term()
    return 0


if __name__ == "__main__":
    sys.exit(main())
