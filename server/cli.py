"""The ``engine`` command: generate, bench, plugins."""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import asdict

from ..benchmarks.serve import add_bench_serve_args
from .engine_args import add_engine_args, engine_config
from .gateway import add_gateway_args
from .serve_args import add_serve_args, bind


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's default shown after its help, unless the help already speaks of it or there is
    none to show (an unset option, a switch)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, False, True, argparse.SUPPRESS) or action.default == []:
            return text
        return super()._get_help_string(action)


def _sized_to_the_prompt(args: argparse.Namespace, fields: dict) -> dict:
    """The engine fields that size the KV cache to this one prompt and its completions (the default
    would reserve 2GiB on a CPU), unless the cache's size or the context was given."""
    from ..core.config import ModelConfig
    from ..core.tokenizer import Tokenizer

    if any(fields[k] is not None for k in ("kv_cache_memory", "num_pages", "max_model_len")):
        return {}
    need = len(Tokenizer.from_dir(fields["model"]).encode(args.prompt)) + args.max_tokens
    if need > ModelConfig.from_dir(fields["model"]).max_model_len:
        return {}  # the request is refused as too long, as ever
    return {"max_model_len": need, "max_num_seqs": min(fields["max_num_seqs"], args.n)}


def _generate(args: argparse.Namespace) -> int:
    from ..core.llm import LLM
    from ..core.sampling_params import SamplingParams

    fields = asdict(engine_config(args))
    fields.update(_sized_to_the_prompt(args, fields))
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
        model_config = ModelConfig.from_dir(engine.model, args.dtype, engine.device or platform.torch_device)
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
    sock = bind(args.host, args.port)  # before anything slow: a port in use fails at once
    from .serve import run_server

    return run_server(args, sock)


def _gateway(args: argparse.Namespace) -> int:
    from .gateway import run_gateway

    return run_gateway(args, args.passthrough)


def _train_drafter(args: argparse.Namespace) -> int:
    from pathlib import Path

    files = []
    for d in args.data:
        p = Path(d)
        files += sorted(str(f) for f in p.rglob(args.glob) if f.is_file()) if p.is_dir() else [str(p)]
    if args.method == "mtp":
        from ..core.spec.train_mtp import train_mtp as train
    else:
        from ..core.spec.dspark.train import train_dspark as train
    k = args.num_speculative_tokens or (3 if args.method == "mtp" else 5)
    report = train(args.model, files, args.out, steps=args.steps, seq_len=args.seq_len, batch=args.batch_size,
                   lr=args.lr, max_tokens=args.max_tokens, seed=args.seed, eval_file=args.eval,
                   num_speculative_tokens=k, seconds=None if args.max_minutes is None else args.max_minutes * 60)
    print(f"trained {report.steps} steps on {report.tokens} tokens in {report.seconds:.0f} s: loss "
          f"{report.first_loss:.3f} -> {report.last_loss:.3f}; wrote {args.out}")
    if report.acceptance_length is not None:
        print(f"held out ({args.eval}): mean acceptance length {report.acceptance_length:.3f} "
              f"at K = {report.num_speculative_tokens}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="engine", description="LLM inference and serving engine",
                                formatter_class=HelpFormatter)
    levels = ["DEBUG", "INFO", "WARNING", "WARN", "ERROR", "CRITICAL"]
    p.add_argument("--log-level", default="INFO", type=str.upper, choices=levels,
                   help="the least severe log lines shown (also after the command: engine serve --log-level DEBUG)")
    sub = p.add_subparsers(dest="command", required=True)

    def command(parent, name: str, **kwargs) -> argparse.ArgumentParser:
        c = parent.add_parser(name, formatter_class=HelpFormatter, **kwargs)
        # after the command too, where a user types it; unset there, the one before it holds
        c.add_argument("--log-level", default=argparse.SUPPRESS, type=str.upper, choices=levels,
                       help="the least severe log lines shown (default: INFO)")
        return c

    g = command(sub, "generate", help="generate text for one prompt")
    add_engine_args(g)
    s = g.add_argument_group("sampling")
    s.add_argument("--prompt", required=True, help="the prompt text (no chat template is applied)")
    s.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    s.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    s.add_argument("--top-p", type=float, default=1.0, help="keep the most likely tokens up to this probability mass")
    s.add_argument("--top-k", type=int, default=0, help="keep this many most likely tokens (0: all)")
    s.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens less likely than this fraction of the most likely one")
    s.add_argument("--n", type=int, default=1, help="completions of the prompt")
    s.add_argument("--sampling-seed", type=int, default=None,
                   help="this request's own seed: the same seed draws the same tokens (unlike --seed, which "
                        "seeds the engine as a whole)")
    s.add_argument("--stop", action="append", default=[],
                   help="end the text where this string appears (repeat for several)")
    s.add_argument("--ignore-eos", action="store_true", help="run to --max-tokens past end-of-sequence tokens")
    g.set_defaults(func=_generate)

    sv = command(sub, "serve", help="serve the OpenAI-compatible HTTP API")
    add_engine_args(sv)
    add_serve_args(sv)
    sv.set_defaults(func=_serve)

    gw = command(sub, "gateway", help="run the gateway (smg) in front of engine workers; other flags go to it",
                        allow_abbrev=False)
    add_gateway_args(gw)
    gw.set_defaults(func=_gateway)

    pl = command(sub, "plugins", help="what was discovered and what each family would select")
    add_engine_args(pl)
    pl.set_defaults(func=_plugins)

    t = command(sub, "train-drafter", help="train a speculative-decoding drafter for a checkpoint from text")
    t.add_argument("--model", required=True, help="the target checkpoint directory")
    t.add_argument("--method", required=True, choices=["mtp", "dspark"],
                   help="mtp: DeepSeek-V4's next-n layer; dspark: a DSpark block drafter (its block: "
                        "--num-speculative-tokens)")
    t.add_argument("--data", required=True, nargs="+", help="text files, or directories searched for --glob")
    t.add_argument("--glob", default="*.py", help="the files a --data directory gives")
    t.add_argument("--out", required=True, help="the drafter directory to write (speculative_config.model)")
    t.add_argument("--steps", type=int, default=300, help="optimizer steps")
    t.add_argument("--max-minutes", type=float, default=None,
                   help="train for at most this long: where it runs out before --steps, the learning-rate "
                        "schedule follows the clock instead")
    t.add_argument("--seq-len", type=int, default=128, help="tokens of one training window")
    t.add_argument("--batch-size", type=int, default=4, help="windows of one step")
    t.add_argument("--lr", type=float, default=2e-3, help="the one-cycle schedule's peak learning rate")
    t.add_argument("--max-tokens", type=int, default=2_000_000, help="tokens of --data read at most")
    t.add_argument("--seed", type=int, default=0, help="seeds the start and the windows drawn")
    t.add_argument("--eval", default=None, help="held-out text: report the mean acceptance length on it")
    t.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="K of the held-out report (default: 3 for mtp, 5 for dspark, its block)")
    t.set_defaults(func=_train_drafter)

    b = command(sub, "bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", required=True)
    off = command(bsub, "offline", help="offline throughput (256 sequences, lengths in [100, 1024])")
    add_engine_args(off)
    off.add_argument("--num-seqs", type=int, default=256, help="sequences, all submitted at once")
    off.add_argument("--min-len", type=int, default=100, help="shortest prompt and output, in tokens")
    off.add_argument("--max-len", type=int, default=1024, help="longest prompt and output, in tokens")
    off.add_argument("--bench-seed", type=int, default=0, help="seeds the drawn prompts and lengths")
    off.add_argument("--json", default=None, help="also write the result as JSON to this path")
    off.set_defaults(func=_bench)
    srv = command(bsub, "serve", help="load a running server over HTTP: throughput, TTFT, ITL, latency")
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
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
