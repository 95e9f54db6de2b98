"""The ``engine`` command: generate, bench, plugins."""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import asdict

from ..benchmarks.serve import add_bench_serve_args
from .engine_args import add_engine_args, engine_config
from .gateway import add_gateway_args
from .serve import add_serve_args


def _generate(args: argparse.Namespace) -> int:
    from ..core.llm import LLM
    from ..core.sampling_params import SamplingParams

    fields = asdict(engine_config(args))
    llm = LLM(fields.pop("model"), **fields)
    params = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            min_p=args.min_p, max_tokens=args.max_tokens, seed=args.sampling_seed,
                            stop=args.stop or None, ignore_eos=args.ignore_eos)
    for out in llm.generate(args.prompt, params):
        for c in out.outputs:
            prefix = f"[{c.index}] " if len(out.outputs) > 1 else ""
            print(f"{prefix}{out.prompt}{c.text}")
            print(f"{prefix}({len(c.token_ids)} tokens, finish_reason={c.finish_reason})", file=sys.stderr)
    return 0


def _plugins(args: argparse.Namespace) -> int:
    from ..core.config import ModelConfig
    from ..core.plugins import load_plugins
    from ..core.plugins_report import report
    from ..core.registry import SelectionContext

    plugins = load_plugins()
    platform = plugins.detect_platform()
    model_config, engine = None, None
    if args.model:
        engine = engine_config(args)
        model_config = ModelConfig.from_dir(args.model, args.dtype, engine.device or platform.torch_device)
    ctx = SelectionContext(platform=platform, model_config=model_config, engine_config=engine)
    requested = engine.requested_backends() if engine else None
    print(report(plugins, ctx, requested))
    return 0


def _bench(args: argparse.Namespace) -> int:
    from ..benchmarks.offline import run_offline_bench

    return run_offline_bench(args)


def _bench_serve(args: argparse.Namespace) -> int:
    from ..benchmarks.serve import run_serve_bench

    return run_serve_bench(args)


def _serve(args: argparse.Namespace) -> int:
    from .serve import run_server

    return run_server(args)


def _gateway(args: argparse.Namespace) -> int:
    from .gateway import run_gateway

    return run_gateway(args, args.passthrough)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="engine", description="LLM inference and serving engine")
    p.add_argument("--log-level", default="INFO")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one prompt")
    add_engine_args(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--n", type=int, default=1)
    g.add_argument("--sampling-seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[])
    g.add_argument("--ignore-eos", action="store_true")
    g.set_defaults(func=_generate)

    sv = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    add_engine_args(sv)
    add_serve_args(sv)
    sv.set_defaults(func=_serve)

    gw = sub.add_parser("gateway", help="run the gateway (smg) in front of engine workers; other flags go to it",
                        allow_abbrev=False)
    add_gateway_args(gw)
    gw.set_defaults(func=_gateway)

    pl = sub.add_parser("plugins", help="what was discovered and what each family would select")
    add_engine_args(pl)
    pl.set_defaults(func=_plugins)

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", required=True)
    off = bsub.add_parser("offline", help="offline throughput (256 sequences, lengths in [100, 1024])")
    add_engine_args(off)
    off.add_argument("--num-seqs", type=int, default=256)
    off.add_argument("--min-len", type=int, default=100)
    off.add_argument("--max-len", type=int, default=1024)
    off.add_argument("--bench-seed", type=int, default=0)
    off.add_argument("--json", default=None, help="also write the result as JSON to this path")
    off.set_defaults(func=_bench)
    srv = bsub.add_parser("serve", help="load a running server over HTTP: throughput, TTFT, ITL, latency")
    add_bench_serve_args(srv)
    srv.set_defaults(func=_bench_serve)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if args.command == "gateway":
        args.passthrough = unknown
    elif unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
