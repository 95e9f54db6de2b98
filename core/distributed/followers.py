"""The other processes of a data-parallel rank whose attention is tensor-parallel (dp_attention.py),
seen from the one that schedules it: every step's host data, or word of an idle step, goes to them
over their sockets, as rank 0 sends it to every rank under tensor parallelism alone (workers.py)."""

from __future__ import annotations

from multiprocessing.connection import Connection

from ..runner import StepInputs
from .messages import Idle, Message, Step, encoder
from .workers import Workers, send_to_all


class Followers:
    """``watched``: rank 0's view of every rank, which explains a failed send by a rank's death
    (None on another data-parallel rank: rank 0 finds the death, the failure stands)."""

    def __init__(self, conns: list[Connection], watched: Workers | None = None) -> None:
        self.conns = conns
        self.watched = watched

    def send_step(self, inputs: StepInputs) -> None:
        self._send(encoder.encode(Step(inputs)))

    def send_idle(self) -> None:
        self._send(encoder.encode(Idle()))

    def send(self, message: Message) -> None:
        self._send(encoder.encode(message))

    def explain(self, exc: BaseException) -> None:
        if self.watched is not None:
            self.watched.explain(exc)

    def _send(self, data: bytes) -> None:
        if self.watched is not None:
            self.watched.check()
        send_to_all(self.conns, data, self.explain)
