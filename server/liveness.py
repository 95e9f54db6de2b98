"""The engine process's pulse: a thread that says ``Alive`` while the engine loop makes progress.

The rule: every ``BEAT_S`` the thread sends ``Alive`` if the loop thread is alive and began its
current iteration less than ``stall_s`` ago. An idle loop begins one every ``BEAT_S`` (its wait
for work times out), a busy one once per step, so only a step that runs past ``stall_s`` (a hang,
or a step far longer than any real one: generous, default 300 s) silences the beats. A stopped or
dead process silences them at once, whatever its loop was doing. The API process calls the engine
unhealthy after ``SILENCE_S`` without a word from it: a few seconds after a SIGSTOP, and never
because one step is long, since beats come from this thread, not from the step.

The thread has its own socket (ZMQ sockets are single-threaded) and never blocks on it: with no
reader, beats are dropped.
"""

from __future__ import annotations

import threading
import time

import zmq


BEAT_S = 0.5
SILENCE_S = 4.0  # the API process's threshold: eight missed beats
DEFAULT_STALL_S = 300.0


class Liveness:
    def __init__(self, ctx: zmq.Context, address: str, stall_s: float = DEFAULT_STALL_S) -> None:
        self.stall_s = stall_s
        self._ctx = ctx
        self._address = address
        self._loop_thread = threading.current_thread()
        self._iteration_began = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="engine-liveness", daemon=True)

    def iteration(self) -> None:
        """The loop calls this as it begins each iteration."""
        self._iteration_began = time.monotonic()

    def making_progress(self) -> bool:
        return self._loop_thread.is_alive() and time.monotonic() - self._iteration_began < self.stall_s

    def _beat(self) -> None:
        from . import wire  # here, so the command line reads this module's bounds without the engine's imports

        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 4)
        sock.connect(self._address)
        alive = wire.encoder.encode(wire.Alive())
        try:
            while not self._stop.wait(BEAT_S):
                if self.making_progress():
                    try:
                        sock.send(alive, flags=zmq.NOBLOCK)
                    except zmq.Again:
                        pass
        finally:
            sock.close()

    def __enter__(self) -> "Liveness":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
