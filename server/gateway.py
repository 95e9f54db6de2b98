"""``engine gateway``: SGLang's gateway (``smg``, the ``gateway`` extra) in front of engine workers.

The engine has no router of its own. This command runs ``smg launch`` with the engine's defaults
(listening on loopback, metrics on loopback, cache-aware routing) and passes every flag it does
not name through unchanged, so any of the gateway's options work (``smg launch --help``):
``--worker-urls URL...`` for replicas, ``--pd-disaggregation --prefill URL PORT --decode URL``
for prefill/decode pairs. ``--api-key`` is the key the workers require; the gateway sends it to them.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

INSTALL_HINT = "engine gateway needs the gateway extra: pip install 'engine[gateway]'"
_LOG_LEVELS = {"DEBUG": "debug", "INFO": "info", "WARNING": "warn", "WARN": "warn", "ERROR": "error",
               "CRITICAL": "error"}


def add_gateway_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("gateway", "every other flag goes to `smg launch` unchanged")
    g.add_argument("--worker-urls", nargs="+", default=None, metavar="URL", help="the engine workers to route to")
    g.add_argument("--policy", default="cache_aware",
                   help="cache_aware, round_robin, power_of_two, least_load, random, ...")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    g.add_argument("--port", type=int, default=30000, help="port to listen on")
    g.add_argument("--prometheus-host", default="127.0.0.1", help="address of the gateway's /metrics listener")
    g.add_argument("--prometheus-port", type=int, default=29000, help="port of the gateway's /metrics listener")
    g.add_argument("--api-key", default=os.environ.get("ENGINE_API_KEY"),
                   help="the workers' key: the gateway sends it to them and requires it of its own clients "
                        "(default: $ENGINE_API_KEY)")
    g.add_argument("--worker-startup-check-interval", type=int, default=2,
                   help="seconds between probes of a worker still loading its model (smg's default: 30)")
    g.add_argument("--health-check-interval-secs", type=int, default=5,
                   help="seconds between health probes of a serving worker (smg's default: 60)")


def smg_argv(args: argparse.Namespace, passthrough: list[str]) -> list[str]:
    """The ``smg launch`` command line for these arguments."""
    argv = [sys.executable, "-m", "smg", "launch", "--host", args.host, "--port", str(args.port),
            "--prometheus-host", args.prometheus_host, "--prometheus-port", str(args.prometheus_port),
            "--policy", args.policy, "--log-level", _LOG_LEVELS.get(args.log_level.upper(), "info"),
            "--worker-startup-check-interval", str(args.worker_startup_check_interval),
            "--health-check-interval-secs", str(args.health_check_interval_secs)]
    if args.worker_urls:
        argv += ["--worker-urls", *args.worker_urls]
    if args.api_key:
        argv += ["--api-key", args.api_key]
    return argv + passthrough


def run_gateway(args: argparse.Namespace, passthrough: list[str]) -> int:
    """Replace this process with the gateway, so signals and the exit status are its own."""
    if importlib.util.find_spec("smg") is None:
        print(INSTALL_HINT, file=sys.stderr)
        return 2
    argv = smg_argv(args, passthrough)
    os.execv(argv[0], argv)
    return 0  # not reached
