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
import os
from pathlib import Path

import uvicorn

from ..core.tokenizer import Tokenizer
from .app import build_app
from .bootstrap import add_disagg_args, disagg_config
from .chat_template import ChatTemplate
from ..core.structured.compiler import GrammarCompiler
from .engine_args import engine_config, parse_size
from .engine_client import EngineClient
from .gate import ServerState
from .http_guard import ConnectionGuard
from .limits import Limits
from .liveness import DEFAULT_STALL_S, SILENCE_S
from .metrics import ServerMetrics
from .openai_serving import Serving
from .reasoning import reasoning_parser, serving_reasoning_parser
from .tool_parsers import serving_tool_format, tool_call_format
from .worker_info import WorkerInfo, worker_disagg

logger = logging.getLogger(__name__)

ENGINE_DEATH_LINGER_S = 2.0
ABORT_GRACE_S = 2.0  # after aborting the rest, how long their clients get to hear it


def add_serve_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=os.environ.get("ENGINE_API_KEY"),
                   help="require this key on every route but /health (default: $ENGINE_API_KEY)")
    g.add_argument("--served-model-name", default=None, help="model name clients use (default: the model directory's name)")
    g.add_argument("--max-concurrent-requests", type=int, default=1024,
                   help="answer 429 past this many requests in flight (0: no limit)")
    g.add_argument("--max-request-body", type=parse_size, default=32 * 2**20,
                   help="refuse larger request bodies with 413 (default 32MiB)")
    g.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a connection has to send a request's headers (from opening, or from its last "
                        "response); then it is closed")
    g.add_argument("--body-timeout", type=float, default=30.0,
                   help="seconds a request has to send its whole body once its headers are in (408 past it)")
    g.add_argument("--max-connections-per-client", type=int, default=256,
                   help="open connections one client address may hold; more are answered 429 and closed "
                        "(0: no limit; raise it behind a proxy, where every client has the proxy's address)")
    g.add_argument("--on-engine-death", choices=["exit", "restart"], default="exit",
                   help="when the engine process dies: exit 1 (for a supervisor to restart), or start a new one")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may run on after SIGTERM before they are aborted")
    g.add_argument("--max-n", type=int, default=Limits.max_n)
    g.add_argument("--max-logprobs", type=int, default=Limits.max_logprobs)
    g.add_argument("--max-stop-sequences", type=int, default=Limits.max_stop_sequences)
    g.add_argument("--max-seqs-per-request", type=int, default=Limits.max_seqs_per_request,
                   help="prompts x n one request may start (400 past it)")
    g.add_argument("--max-logprob-entries", type=int, default=Limits.max_logprob_entries,
                   help="logprob values one answer may carry: tokens x choices x (logprobs + 1), echoed "
                        "prompt tokens counted in every choice (400 past it)")
    g.add_argument("--engine-stall-timeout", type=float, default=DEFAULT_STALL_S,
                   help="seconds one engine step may run before /health turns 503 (a stopped or dead engine "
                        f"turns it 503 after {SILENCE_S:g} s of silence whatever this is)")
    g.add_argument("--engine-start-timeout", type=float, default=None, help="seconds to wait for the model to load")
    g.add_argument("--tool-call-parser", default="auto", type=_known(tool_call_format), metavar="NAME",
                   help="how the model writes tool calls: hermes (Qwen3), deepseek_v3, deepseek_v31, deepseek_v4 "
                        "(DSML), or none; auto (default): read from the chat template and the tokenizer's tokens")
    g.add_argument("--reasoning-parser", default="auto", type=_known(reasoning_parser), metavar="NAME",
                   help="split <think> reasoning into reasoning_content: qwen3, deepseek_r1, deepseek_v3, "
                        "deepseek_v4, or none; auto (default): where the chat template writes <think>, or the "
                        "tokenizer has it as a token")
    add_disagg_args(p)


def _known(check):
    """An argparse type: ``auto``, ``none``, or a name ``check`` knows."""
    def parse(name: str) -> str:
        if name not in ("auto", "none"):
            try:
                check(name)
            except ValueError as exc:
                raise argparse.ArgumentTypeError(str(exc)) from None
        return name
    return parse


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


def run_server(args: argparse.Namespace) -> int:
    config = dataclasses.replace(engine_config(args), disaggregation=disagg_config(args))
    limits = Limits(max_n=args.max_n, max_logprobs=args.max_logprobs, max_stop_sequences=args.max_stop_sequences,
                    max_seqs_per_request=args.max_seqs_per_request, max_logprob_entries=args.max_logprob_entries)
    state = ServerState(api_key=args.api_key or None, max_concurrent_requests=args.max_concurrent_requests or None,
                        max_body_bytes=args.max_request_body, body_timeout=args.body_timeout)
    guard = ConnectionGuard(args.header_timeout, args.max_connections_per_client or None)
    name = args.served_model_name or Path(config.model).name
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
            template = ChatTemplate(tokenizer.chat_template, token(tokenizer.bos_token_id), token(tokenizer.eos_token_id))
            grammars = GrammarCompiler(tokenizer, info.vocab_size, config.grammar_compile_timeout,
                                       config.grammar_cache_memory)
            added = [t.content for t in tokenizer.backend.get_added_tokens_decoder().values()]
            tools = serving_tool_format(args.tool_call_parser, tokenizer.chat_template, added)
            reasoning = serving_reasoning_parser(args.reasoning_parser, tokenizer.chat_template, added)
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
    server.run()
    if state.serving is None and server.exit_code == 0:
        return 1  # never started
    return server.exit_code
