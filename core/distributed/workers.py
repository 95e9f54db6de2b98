"""Rank 0's side of a tensor-parallel group: the other ranks' processes, started and stopped
together, told every step, and watched.

Each rank is a fresh interpreter (``python -m engine.core.distributed.worker``, as the server starts
its engine process): a GPU context never crosses a fork, and unlike multiprocessing's spawn it
does not re-run the caller's main script, so ``LLM(..., tensor_parallel_size=2)`` works in a script
without a ``__main__`` guard. It gets the engine config as JSON on stdin and the port of rank 0's
TCP store, and joins the group from there (group.py). A socket pair per rank carries msgpack
messages (messages.py): ``Ready`` or ``Failed`` once built, then ``Step`` per step (and MTP's drafting
forwards, ``Draft``: core/spec/mtp.py), ``Stop`` at the end;
under data-parallel attention ``RankRequests`` per step to the process that schedules each
data-parallel rank, answered on a second pair (dp_attention.py), and from that process ``Step`` or
``Idle`` to the others of its rank, on a pair rank 0 made for them (followers.py).

A rank that dies closes its socket; a thread waiting on the sockets records which rank and aborts
the group, so a collective rank 0 waits in fails at once instead of at its timeout (gloo fails it
anyway when the peer's socket closes). The engine then fails with ``EngineDeadError`` naming the
rank and its exit code, at the step in flight or at the next one, and never hangs.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import asdict
from multiprocessing.connection import Connection, wait

from ..config import EngineConfig
from ..errors import EngineDeadError
from ..runner import StepInputs
from .group import ParallelGroup, Rendezvous, master_store
from .messages import Failed, Message, Ready, Step, Stop, decoder, encoder
from .multicast import multicast_off

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 10.0  # how long a rank may take to exit once told to stop


class Workers:
    def __init__(self, config: EngineConfig) -> None:
        size, timeout = config.tensor_parallel_size, config.distributed_timeout
        self.timeout = timeout
        self.store = master_store(size, timeout)
        self.rendezvous = Rendezvous(0, size, self.store, timeout)
        self.groups: list[ParallelGroup] = []  # rank 0's, aborted when a rank dies
        self.dead: tuple[int, int | None] | None = None  # (rank, exit code) of the first rank that died
        self._closed = False
        payload = json.dumps(asdict(config)).encode()
        level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
        self.procs: list[subprocess.Popen] = []
        self.conns: list[Connection] = []
        self.replies: list[Connection] = []  # data-parallel ranks answer each step here (the watchdog reads conns)
        per_dp = config.attention_tp_size if config.enable_dp_attention else size  # processes of a DP rank
        from_leader: dict[int, socket.socket] = {}  # a process's end of its leader's socket (DP ranks but 0)
        for rank in range(1, size):
            ours, theirs = socket.socketpair()
            cmd = [sys.executable, "-m", f"{__package__}.worker", "--rank", str(rank), "--size", str(size),
                   "--port", str(self.store.port), "--fd", str(theirs.fileno()), "--log-level", level]
            fds = [theirs]
            if config.enable_dp_attention and rank % per_dp == 0:  # it schedules a data-parallel rank
                ours_r, theirs_r = socket.socketpair()
                cmd += ["--replies-fd", str(theirs_r.fileno())]
                fds.append(theirs_r)
                self.replies.append(Connection(ours_r.detach()))
                for follower in range(rank + 1, rank + per_dp):
                    to_follower, from_leader[follower] = socket.socketpair()
                    cmd += ["--follower-fd", str(to_follower.fileno())]
                    fds.append(to_follower)
            elif rank in from_leader:
                cmd += ["--leader-fd", str(from_leader[rank].fileno())]
                fds.append(from_leader.pop(rank))
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, pass_fds=[f.fileno() for f in fds],
                                    env=multicast_off(dict(os.environ)))
            for f in fds:
                f.close()
            proc.stdin.write(payload)
            proc.stdin.close()
            self.procs.append(proc)
            self.conns.append(Connection(ours.detach()))
        self._wake_r, self._wake_w = socket.socketpair()
        self._finalizer = weakref.finalize(self, Workers._stop, self.procs, self.conns, self.replies, self._wake_w)

    # -- start-up -------------------------------------------------------------------------------

    def ready(self, *groups: ParallelGroup) -> None:
        """Wait until every rank is built (rank 0 is, with ``groups``), then watch them; raise the
        first that failed to start."""
        self.groups = list(groups)
        deadline = time.monotonic() + self.timeout
        for rank, conn in enumerate(self.conns, start=1):
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                raise EngineDeadError(f"tensor-parallel rank {rank} did not start within {self.timeout:.0f} s")
            try:
                msg = decoder.decode(conn.recv_bytes())
            except EOFError:
                msg = Failed(rank, f"exited with code {self.procs[rank - 1].wait(STOP_TIMEOUT_S)}")
            if not isinstance(msg, Ready):
                raise EngineDeadError(f"tensor-parallel rank {rank} failed to start: {msg.error}")
        threading.Thread(target=self._watch, name="engine-tp-watchdog", daemon=True).start()

    # -- steps ----------------------------------------------------------------------------------

    def send_step(self, inputs: StepInputs) -> None:
        self.send(Step(inputs))

    def send(self, message: Message) -> None:
        self.check()
        send_to_all(self.conns, encoder.encode(message), self.explain)

    def check(self) -> None:
        """Raise ``EngineDeadError`` if a rank has died."""
        if self.dead is not None:
            rank, code = self.dead
            raise EngineDeadError(f"tensor-parallel rank {rank} died (exit code {code}); the engine cannot continue")

    def explain(self, exc: BaseException, wait_s: float = 2.0) -> None:
        """After a failed step: raise the death of a rank that caused it (given ``wait_s`` for the
        watchdog to see it), else return and let ``exc`` stand."""
        deadline = time.monotonic() + wait_s
        while self.dead is None and not self._closed and time.monotonic() < deadline:
            time.sleep(0.01)
        self.check()

    def _watch(self) -> None:
        """Wait for a rank's socket to close (it sends nothing once ready): that rank is dead."""
        ready = wait([*self.conns, self._wake_r])
        if self._closed or self._wake_r in ready:
            return
        rank = next(r for r, conn in enumerate(self.conns, start=1) if conn in ready)
        proc = self.procs[rank - 1]
        try:
            code = proc.wait(1.0)
        except subprocess.TimeoutExpired:
            code = None  # its socket closed, the process lingers: dead to the group all the same
        logger.error("tensor-parallel rank %d (pid %d) died with exit code %s", rank, proc.pid, code)
        for group in self.groups:
            group.close(abort=True)
        # last: a failed step waits for this (explain), and its engine may be dropped at once; this thread
        # then holds the last reference only for a moment (a finalizer run here may be cut off at exit)
        self.dead = (rank, code)

    # -- the end --------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop every rank and release the group; after a rank died, kill the others (of no use
        without it, and slow to unwind from their failed collectives on a busy host)."""
        if self._closed:
            return
        self._closed = True
        if self.dead is not None:
            for proc in self.procs:
                if proc.poll() is None:
                    proc.kill()
        self._finalizer()
        if self.dead is None:
            for group in self.groups:
                group.close()

    @staticmethod
    def _stop(procs: list[subprocess.Popen], conns: list[Connection], replies: list[Connection],
              wake: socket.socket) -> None:
        wake.send(b"x")
        for conn in conns:
            try:
                conn.send_bytes(encoder.encode(Stop()))
            except OSError:
                pass
            conn.close()
        for conn in replies:
            conn.close()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for proc in procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def send_to_all(conns: list[Connection], data: bytes, explain) -> None:
    """``data`` to every rank's socket; a failed send is first given to ``explain`` (which raises a
    rank's death where one caused it), else it stands."""
    try:
        for conn in conns:
            conn.send_bytes(data)
    except OSError as exc:
        explain(exc)
        raise
