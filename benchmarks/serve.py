"""`engine bench serve`: load a running server through its HTTP API and measure what clients see.

Requests arrive as a Poisson process at ``--request-rate`` (``inf``: all at once), at most
``--max-concurrency`` in flight, each a streamed /v1/completions with token-id prompts of set
lengths (``random``) or a few shared prefixes plus random suffixes (``shared-prefix``), and
``ignore_eos`` so output lengths are what was asked. Reports request and token throughput and
mean/p50/p99 of TTFT, TPOT (per output token after the first), ITL (between chunks) and
end-to-end latency, as text and (``--json``) as JSON. Two progress bars follow the run: first
tokens (prefills done) and completed requests; the HTTP client's per-request log lines are shown
only at ``--log-level DEBUG``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from .offline import _commit

if TYPE_CHECKING:
    import httpx


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    input_tokens: int = 0
    output_tokens: int = 0


def add_bench_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    p.add_argument("--api-key", default=None, help="the server's API key, if it wants one")
    p.add_argument("--dataset", choices=["random", "shared-prefix"], default="random",
                   help="random token-id prompts, or a few shared prefixes each followed by a random suffix")
    p.add_argument("--num-prompts", type=int, default=200, help="requests to send")
    p.add_argument("--input-len", type=int, default=256, help="prompt tokens (shared-prefix: after the prefix)")
    p.add_argument("--output-len", type=int, default=64, help="tokens each request generates (ignore_eos)")
    p.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: tokens of each shared prefix")
    p.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: distinct prefixes")
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests/s, Poisson; inf: all at once")
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most (default: no limit)")
    p.add_argument("--bench-seed", type=int, default=0, help="seeds the prompts and the arrival times")
    p.add_argument("--json", default=None, help="also write the result as JSON to this path")


def dataset(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    rng = random.Random(args.bench_seed)
    low = min(100, vocab // 2)  # keep clear of the special tokens most vocabularies start with

    def tokens(n: int) -> list[int]:
        return [rng.randrange(low, vocab) for _ in range(n)]

    if args.dataset == "random":
        return [tokens(args.input_len) for _ in range(args.num_prompts)]
    prefixes = [tokens(args.prefix_len) for _ in range(args.num_prefixes)]
    return [prefixes[i % args.num_prefixes] + tokens(args.input_len) for i in range(args.num_prompts)]


async def _one(client: httpx.AsyncClient, url: str, body: dict, first_token: Callable[[], None]) -> Result:
    import httpx

    res = Result(input_tokens=len(body["prompt"]))
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = chunk["error"]["message"]
                    return res
                now = time.perf_counter()
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                    res.input_tokens = chunk["usage"].get("prompt_tokens", res.input_tokens)  # text prompts too
                elif chunk["choices"]:
                    if res.ttft == 0.0:
                        res.ttft = now - start
                        first_token()
                    else:
                        res.itl.append(now - last)
                    last = now
        res.e2e = time.perf_counter() - start
        res.ok = True
    except httpx.HTTPError as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    return res


def _summary(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean_ms": 0.0, "p50_ms": 0.0, "p99_ms": 0.0}
    v = sorted(values)
    pct = lambda q: v[min(len(v) - 1, int(round(q * (len(v) - 1))))]  # noqa: E731
    return {"mean_ms": round(1000 * statistics.fmean(v), 3), "p50_ms": round(1000 * pct(0.5), 3),
            "p99_ms": round(1000 * pct(0.99), 3)}


async def _run(args: argparse.Namespace) -> dict:
    import httpx
    from tqdm import tqdm

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.max_concurrency or 10_000, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600, connect=30), headers=headers, limits=limits) as client:
        info = (await client.get(args.url + "/v1/models")).raise_for_status().json()["data"][0]
        model = args.model or info["id"]
        prompts = dataset(args, info.get("vocab_size", 1000))
        rng = random.Random(args.bench_seed + 1)
        gate = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        firsts = tqdm(total=len(prompts), desc="first tokens", unit="req", position=0)
        bar = tqdm(total=len(prompts), desc="completed", unit="req", position=1)

        async def send(prompt: list[int]) -> Result:
            body = {"model": model, "prompt": prompt, "max_tokens": args.output_len, "ignore_eos": True,
                    "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
            if gate is None:
                res = await _one(client, args.url, body, firsts.update)
            else:
                async with gate:
                    res = await _one(client, args.url, body, firsts.update)
            bar.update(1)
            return res

        tasks = []
        start = time.perf_counter()
        for prompt in prompts:
            tasks.append(asyncio.create_task(send(prompt)))
            if math.isfinite(args.request_rate):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        firsts.close()
        bar.close()
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.input_tokens for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "benchmark": "serve", "url": args.url, "model": model, "dataset": args.dataset,
        "num_prompts": len(prompts), "input_len": args.input_len, "output_len": args.output_len,
        "prefix_len": args.prefix_len if args.dataset == "shared-prefix" else 0,
        "request_rate": "inf" if not math.isfinite(args.request_rate) else args.request_rate,
        "max_concurrency": args.max_concurrency, "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5], "duration_s": round(duration, 3),
        "input_tokens": in_tokens, "output_tokens": out_tokens,
        "request_throughput": round(len(ok) / duration, 3),
        "input_token_throughput": round(in_tokens / duration, 2),
        "output_token_throughput": round(out_tokens / duration, 2),
        "total_token_throughput": round((in_tokens + out_tokens) / duration, 2),
        "ttft": _summary([r.ttft for r in ok]), "tpot": _summary(tpot),
        "itl": _summary([x for r in ok for x in r.itl]), "e2e": _summary([r.e2e for r in ok]),
        "commit": _commit(),
    }


def report(result: dict) -> str:
    lines = [f"{'completed':<28}{result['completed']} of {result['num_prompts']} ({result['failed']} failed)",
             f"{'duration':<28}{result['duration_s']:.2f} s",
             f"{'request throughput':<28}{result['request_throughput']:.2f} req/s",
             f"{'output token throughput':<28}{result['output_token_throughput']:.1f} tok/s",
             f"{'total token throughput':<28}{result['total_token_throughput']:.1f} tok/s"]
    for key, name in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e", "E2E latency")):
        s = result[key]
        lines.append(f"{name + ' (ms)':<28}mean {s['mean_ms']:.2f}  p50 {s['p50_ms']:.2f}  p99 {s['p99_ms']:.2f}")
    return "\n".join(lines)


def run_serve_bench(args: argparse.Namespace) -> int:
    if not logging.getLogger().isEnabledFor(logging.DEBUG):  # a line per request hides the progress bars
        for name in ("httpx", "httpcore"):
            logging.getLogger(name).setLevel(logging.WARNING)
    result = asyncio.run(_run(args))
    print(report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["failed"] == 0 else 1
