"""A tensor-parallel rank other than 0: a process that holds its slices of the weights and of the KV
cache and runs every step rank 0 sends it, until told to stop or rank 0 is gone. Under
data-parallel attention the first process of each data-parallel rank is an engine core of its own
instead, serving the requests rank 0 routes to it one step at a time (dp_attention.py), and sends
each step to the other processes of its rank, which run it as above.

Started by rank 0 as ``python -m engine.core.distributed.worker`` (workers.py) with the engine
config as JSON on stdin and one end of a socket pair as a file descriptor. It schedules nothing and
samples nothing: rank 0 sends each step's host data over that socket (``Step``), and the forward's
collectives bring in the rest (the input tokens only rank 0's device holds, the partial sums, the
logits). A rank that cannot start says why (``Failed``) before it exits; a rank whose parent is
gone exits, even from the middle of a collective.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time
from multiprocessing.connection import Connection

from ..config import EngineConfig
from .group import Rendezvous, join_store
from .messages import Draft, DraftBlock, DraftCount, Failed, Idle, Ready, Step, Stop, decoder, encoder

logger = logging.getLogger("engine.core.distributed.worker")

PARENT_POLL_S = 0.5


def _exit_with_parent(parent: int) -> None:
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="engine-tp-parent", daemon=True).start()


def serve(conn: Connection, runner, proposer=None) -> None:
    """Run steps, and ``proposer``'s drafting forwards, until ``Stop`` or until the process that
    schedules them closes the socket."""
    while True:
        try:
            msg = decoder.decode(conn.recv_bytes())
        except EOFError:
            return
        if isinstance(msg, Stop):
            return
        if isinstance(msg, Step):
            runner.follow(msg.inputs)
        elif isinstance(msg, Idle):
            runner.idle()
        elif isinstance(msg, (Draft, DraftBlock, DraftCount)):
            proposer.follow(msg)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="a tensor-parallel rank (started by the engine)")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--port", type=int, required=True, help="rank 0's TCP store on 127.0.0.1")
    p.add_argument("--fd", type=int, required=True, help="this rank's end of the socket pair to rank 0")
    p.add_argument("--replies-fd", type=int, default=None,
                   help="data-parallel attention: this rank's end of the pipe its step outputs go back on")
    p.add_argument("--follower-fd", type=int, action="append", default=[],
                   help="data-parallel attention: the socket to another process of this data-parallel rank")
    p.add_argument("--leader-fd", type=int, default=None,
                   help="data-parallel attention: the socket from the process that schedules this one's rank "
                        "(default: --fd, rank 0's)")
    p.add_argument("--log-level", default="WARNING")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s tp-rank{args.rank}: %(message)s")
    _exit_with_parent(os.getppid())
    conn = Connection(args.fd)
    from ..engine import EngineCore
    from ..runner import ModelRunner
    from ..startup import build
    from .dp_attention import serve_requests

    try:
        config = EngineConfig(**json.loads(sys.stdin.read()))
        store = join_store(args.port, args.size, config.distributed_timeout)
        rendezvous = Rendezvous(args.rank, args.size, store, config.distributed_timeout)
        # under data-parallel attention the first process of each data-parallel rank schedules it, a whole
        # engine of its own requests (dp_attention.py); the others follow it as tensor-parallel ranks
        schedules = config.enable_dp_attention and args.rank % config.attention_tp_size == 0
        if schedules:
            core = EngineCore(config, progress=False, rendezvous=rendezvous,
                              followers=[Connection(fd) for fd in args.follower_fd])
            c = core.components
        else:
            c = build(config, progress=False, rendezvous=rendezvous)
            runner = ModelRunner(c.model, c.kv, None, None, config.page_size, c.device, c.graphs, c.attention_group,
                                 prefill_graphs=c.prefill_graphs, verify_graphs=c.verify_graphs, agree=c.plan_group)
        conn.send_bytes(encoder.encode(Ready(args.rank)))
    except BaseException as exc:
        logger.exception("could not start")
        conn.send_bytes(encoder.encode(Failed(args.rank, f"{type(exc).__name__}: {exc}")))
        return 1
    try:
        if schedules:
            core.time_verify_step()
            serve_requests(conn, Connection(args.replies_fd), core)
        else:
            serve(Connection(args.leader_fd) if args.leader_fd is not None else conn, runner, c.proposer)
    finally:
        c.attention_group.close()
        c.plan_group.close()
        c.group.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
