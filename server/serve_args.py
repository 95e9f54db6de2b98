"""The flags of ``engine serve`` beyond the engine's own (engine_args.py); light to import, so that
``engine --help`` answers at once."""

from __future__ import annotations

import argparse
import os
import socket

from .bootstrap import add_disagg_args
from .engine_args import parse_size
from .limits import Limits
from .liveness import DEFAULT_STALL_S, SILENCE_S
from .reasoning import reasoning_parser
from .tool_parsers import tool_call_format


def add_serve_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    g.add_argument("--port", type=int, default=8000, help="port to listen on")
    g.add_argument("--api-key", default=os.environ.get("ENGINE_API_KEY"),
                   help="require this key on every route but /health (default: $ENGINE_API_KEY)")
    g.add_argument("--served-model-name", default=None, help="model name clients use (default: the model directory's name)")
    g.add_argument("--max-concurrent-requests", type=int, default=1024,
                   help="answer 429 past this many requests in flight (0: no limit)")
    g.add_argument("--max-request-body", type=parse_size, default="32MiB",
                   help="refuse larger request bodies with 413")
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
    g.add_argument("--max-n", type=int, default=Limits.max_n, help="largest n a request may ask (400 past it)")
    g.add_argument("--max-logprobs", type=int, default=Limits.max_logprobs,
                   help="most logprobs (top alternatives) per token a request may ask (400 past it)")
    g.add_argument("--max-stop-sequences", type=int, default=Limits.max_stop_sequences,
                   help="most stop strings a request may give (400 past it)")
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
                   help="how the model writes tool calls: hermes (Qwen3), deepseek_v3, deepseek_v31, deepseek_v32, "
                        "deepseek_v4 (DSML), or none; auto (default): read from the chat template and the tokenizer's tokens")
    g.add_argument("--chat-template", default=None, type=_chat_template, metavar="FILE|NAME",
                   help="how chat requests become prompts: a Jinja template file, or deepseek_v4 (DeepSeek-V4's "
                        "encoding); default: the tokenizer's template, else the architecture's encoding "
                        "(DeepSeek-V4's for DeepseekV4ForCausalLM), else role: content lines")
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


def _chat_template(choice: str) -> str:
    from .chat_format import check_chat_template  # jinja2: only where the flag is given

    try:
        return check_chat_template(choice)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def bind(host: str, port: int) -> socket.socket:
    """The listening address, taken before the model loads so a port in use fails at once (uvicorn
    listens on it once the engine is ready)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise SystemExit(f"engine: error: cannot listen on {host}:{port}: {exc.strerror}") from None
    return sock
