"""The engine's pulse: beats while its loop iterates, through a long step, and stops at a stall."""

from __future__ import annotations

import threading
import time

import zmq

from engine.server import liveness, wire
from engine.server.liveness import Liveness


def _beats(pull: zmq.Socket, seconds: float) -> int:
    """Alive messages received over ``seconds``."""
    deadline, count = time.monotonic() + seconds, 0
    while (left := deadline - time.monotonic()) > 0:
        if pull.poll(int(left * 1000)):
            assert isinstance(wire.from_engine_decoder.decode(pull.recv()), wire.Alive)
            count += 1
    return count


def test_beats_through_a_long_step_and_stop_at_a_stall(tmp_path, monkeypatch):
    monkeypatch.setattr(liveness, "BEAT_S", 0.05)
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    address = f"ipc://{tmp_path}/out"
    pull.bind(address)
    try:
        with Liveness(ctx, address, stall_s=1.0) as pulse:
            pulse.iteration()  # a step begins and runs 0.7 s without another iteration
            assert _beats(pull, 0.7) >= 8
            _beats(pull, 0.4)  # the step passes the stall bound
            assert _beats(pull, 0.5) == 0 and not pulse.making_progress()
            pulse.iteration()  # the loop moves again
            assert _beats(pull, 0.3) >= 3
    finally:
        pull.close(linger=0)
        ctx.term()


def test_a_dead_loop_thread_is_not_alive(tmp_path):
    made: list[Liveness] = []
    loop = threading.Thread(target=lambda: made.append(Liveness(zmq.Context.instance(), f"ipc://{tmp_path}/x")))
    loop.start()
    loop.join()
    assert not made[0].making_progress()
