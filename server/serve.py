"""``engine serve``: the API process. Starts the engine process, serves HTTP, drains on SIGTERM.

SIGTERM or SIGINT (to this process or to its whole process group: the engine process runs in its
own session and never sees them) stops admitting: generation routes and /health answer 503 while
in-flight requests run on for up to ``--shutdown-timeout`` seconds; what is left is then aborted
(its clients get ``finish_reason: "abort"``), the engine process is stopped and reaped, and the
server exits 0. A dead engine turns /health to 503 at once and fails waiting requests with 500;
then the server exits 1 after ``ENGINE_DEATH_LINGER_S`` (so probes can see the 503), or, with
``--on-engine-death restart``, starts a new engine process and serves again once it is ready.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import socket

import torch
import uvicorn

from ..core.model_path import served_name
from ..core.threads import usable_cores
from ..core.tokenizer import Tokenizer
from .app import build_app
from .bootstrap import disagg_config
from .chat_format import chat_renderer
from ..core.structured.compiler import GrammarCompiler
from .engine_args import engine_config
from .engine_client import EngineClient
from .gate import ServerState
from .http_guard import ConnectionGuard
from .limits import Limits
from .metrics import ServerMetrics
from .openai_serving import Serving
from .reasoning import serving_reasoning_parser
from .tool_parsers import serving_tool_format
from .worker_info import WorkerInfo, worker_disagg

logger = logging.getLogger(__name__)

ENGINE_DEATH_LINGER_S = 2.0
ABORT_GRACE_S = 2.0  # after aborting the rest, how long their clients get to hear it


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.state = state
        self.shutdown_timeout = shutdown_timeout
        self.exit_code = 0
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        if self.state.draining or self._loop is None or self.state.serving is None:
            return super().handle_exit(sig, frame)
        self.state.draining = True
        logger.info("signal %d: draining %d requests (up to %.0f s)", sig, self.state.in_flight, self.shutdown_timeout)
        self._loop.call_soon_threadsafe(lambda: self._loop.create_task(self._drain()))

    async def _drain(self) -> None:
        await self._wait_idle(self.shutdown_timeout)
        if self.state.in_flight:
            logger.warning("aborting %d requests still running after %.0f s", self.state.in_flight,
                           self.shutdown_timeout)
            self.state.serving.client.abort_all()
            await self._wait_idle(ABORT_GRACE_S)
        self.should_exit = True

    async def _wait_idle(self, seconds: float) -> None:
        deadline = self._loop.time() + seconds
        while self.state.in_flight and self._loop.time() < deadline:
            await asyncio.sleep(0.05)

    def engine_died(self, reason: str, restart) -> None:
        """Exit 1 after a short linger, or run ``restart`` (a coroutine function) to bring a new engine up."""
        if restart is None or self.state.draining:
            self.exit_code = 1
            self._loop.call_later(ENGINE_DEATH_LINGER_S, setattr, self, "should_exit", True)
        else:
            self._loop.create_task(restart())


def engine_process_threads() -> int:
    """Torch threads for the engine process: the cores it may use, less one for this process."""
    return max(1, usable_cores() - 1)


def run_server(args: argparse.Namespace, sock: socket.socket) -> int:
    """Serve on ``sock``, bound already (serve_args.bind)."""
    config = engine_config(args)
    config = dataclasses.replace(config, disaggregation=disagg_config(args),
                                 cpu_threads=config.cpu_threads or engine_process_threads())
    torch.set_num_threads(1)  # the API process: tokenizing and detokenizing beside the engine's threads
    limits = Limits(max_n=args.max_n, max_logprobs=args.max_logprobs, max_stop_sequences=args.max_stop_sequences,
                    max_seqs_per_request=args.max_seqs_per_request, max_logprob_entries=args.max_logprob_entries)
    state = ServerState(api_key=args.api_key or None, max_concurrent_requests=args.max_concurrent_requests or None,
                        max_body_bytes=args.max_request_body, body_timeout=args.body_timeout)
    guard = ConnectionGuard(args.header_timeout, args.max_connections_per_client or None)
    name = args.served_model_name or served_name(args.model or config.model, config.model)
    server: DrainingServer | None = None

    def new_client() -> EngineClient:
        return EngineClient(config, args.log_level, on_death=lambda why: server.engine_died(why, restart),
                            stall_timeout=args.engine_stall_timeout)

    async def restart() -> None:
        old = state.serving.client
        await old.shutdown()
        client = new_client()
        logger.warning("starting a new engine process")
        try:
            await client.start(args.engine_start_timeout)
        except Exception:
            logger.exception("the new engine failed to start; exiting")
            await client.shutdown()
            server.engine_died("restart failed", None)
            return
        state.serving.client = client
        logger.info("the new engine process %d serves", client.pid)

    if args.on_engine_death != "restart":
        restart = None

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        client = new_client()
        try:
            info = await client.start(args.engine_start_timeout)
            tokenizer = Tokenizer.from_dir(config.model)
            token = lambda i: tokenizer.convert_ids_to_tokens(i) if i is not None else None  # noqa: E731
            template = chat_renderer(args.chat_template, config.model, tokenizer.chat_template,
                                     token(tokenizer.bos_token_id), token(tokenizer.eos_token_id))
            grammars = GrammarCompiler(tokenizer, info.vocab_size, config.grammar_compile_timeout,
                                       config.grammar_cache_memory)
            added = [t.content for t in tokenizer.backend.get_added_tokens_decoder().values()]
            tools = serving_tool_format(args.tool_call_parser, template.source, added)
            reasoning = serving_reasoning_parser(args.reasoning_parser, template.source, added)
            logger.info("tool-call parser: %s; reasoning parser: %s", tools.name if tools else "none", reasoning or "none")
            state.serving = Serving(client, tokenizer, template, ServerMetrics(name, info.page_size, info.num_pages),
                                    limits, name, info.max_model_len, info.vocab_size, grammars, config.disaggregation,
                                    tools, reasoning)
            state.worker = WorkerInfo.of(config.model, name, max_model_len=info.max_model_len,
                                         page_size=info.page_size, num_pages=info.num_pages,
                                         max_running_requests=config.max_num_seqs,
                                         max_prefill_tokens=config.max_num_batched_tokens,
                                         **worker_disagg(config.disaggregation))
            logger.info("serving %r on http://%s:%d (max context %d)", name, args.host, args.port, info.max_model_len)
            yield
        finally:
            await (state.serving.client if state.serving else client).shutdown()
            logger.info("engine process stopped")

    uv = uvicorn.Config(build_app(state, lifespan), host=args.host, port=args.port, log_level=args.log_level.lower(),
                        timeout_graceful_shutdown=5, access_log=False, lifespan="on", http=guard.protocol(),
                        ws="none")
    server = DrainingServer(uv, state, args.shutdown_timeout)
    server.run(sockets=[sock])
    if state.serving is None and server.exit_code == 0:
        return 1  # never started
    return server.exit_code
