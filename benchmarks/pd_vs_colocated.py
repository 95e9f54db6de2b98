"""Prefill/decode disaggregation against colocated serving, and the gateway's cache-aware routing
against round robin, each through `engine gateway` in front of `engine serve` processes it starts.

``pd``: ``--decoders`` streams with short prompts decode ``--decode-len`` tokens each while
``--long-prompts`` prompts of about ``--long-len`` words arrive (Poisson, ``--long-rate`` per
second) asking ``--long-output`` tokens: once on one colocated server, once on a prefill and a
decode server (``--pd-disaggregation``, the ``--transfer-backend`` moving the KV). Reported per
setup: the decoders' ITL and TPOT (mean/p50/p99: a long prefill in the same batch stalls them when
colocated), the long prompts' TTFT, and the decode server's KV transfer totals.

``gateway``: for each count in ``--replicas``, that many servers behind a ``round_robin`` and a
``cache_aware`` gateway in turn; ``--tenants`` tenants, each with a prefix of ``--prefix-len``
words of its own (fresh for each gateway), ask ``--turns`` questions each (every tenant once a
turn, in a random order), ``--concurrency`` at a time. Reported per policy: the replicas' prefix-cache hit rate (engine:prefix_cache_hits_total over
queries_total on their /metrics, over this run), request and token throughput, TTFT.

Every server shares ``--server-args``; two on one GPU need their KV budgets split, e.g. on an H200
(a random Qwen3-0.6B-shaped checkpoint):

    python3 -c "from engine.checkpoints import write_checkpoint; write_checkpoint('/tmp/qwen3-0.6b', 'qwen3-0.6b')"
    python3 benchmarks/pd_vs_colocated.py --model /tmp/qwen3-0.6b --server-args "--kv-cache-memory 16GiB \\
        --max-model-len 10240" --decoders 32 --decode-len 256 --long-prompts 32 --long-len 8000 --long-rate 2 \\
        --replicas 2 4 --tenants 16 --prefix-len 2000 --turns 8 --concurrency 16 \\
        --json benchmarks/results/pd-vs-colocated-h200.json

On the CPU, at tiny sizes (what the script does, not what PD is worth):

    python benchmarks/pd_vs_colocated.py --model ../shared/models/tiny-qwen3-py \\
        --json benchmarks/results/pd-vs-colocated-cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from engine.benchmarks.common import commit, write_result
from engine.benchmarks.serve import Result, _one, _summary

API_KEY = "bench-key-0123456789"
WORDS = ["alpha", "ledger", "kernel", "invoice", "river", "socket", "margin", "plasma", "harbor", "quota",
         "signal", "tensor", "copper", "meadow", "vector", "lantern"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """`engine serve` or `engine gateway` in a subprocess on a free loopback port, its log in ``logs``."""

    def __init__(self, command: str, args: list[str], logs: Path, name: str) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        extra = ["--prometheus-port", str(_free_port())] if command == "gateway" else []
        self.log = open(logs / f"{name}.log", "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "engine.server.cli", "--log-level", "WARNING", command,
                                      "--port", str(self.port), "--api-key", API_KEY, *extra, *args],
                                     stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, "NO_COLOR": "1"})

    def wait(self, ready, timeout: float = 600.0) -> Proc:
        deadline = time.monotonic() + timeout
        while not _probe(ready, self):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{self.log.name} did not get ready:\n{Path(self.log.name).read_text()[-2000:]}")
            time.sleep(0.3)
        return self

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def _probe(ready, p: Proc) -> bool:
    try:
        return ready(p)
    except (httpx.HTTPError, KeyError, ValueError):
        return False


def _healthy(p: Proc) -> bool:
    return httpx.get(p.url + "/health", timeout=2).status_code == 200


def _workers_ready(n: int):
    def ready(gw: Proc) -> bool:
        ws = httpx.get(gw.url + "/workers", headers=_HEADERS, timeout=5).json()["workers"]
        return len(ws) == n and all(w["is_healthy"] and w["status"] == "ready" for w in ws)
    return ready


_HEADERS = {"Authorization": f"Bearer {API_KEY}"}


def _metrics(p: Proc) -> dict[str, float]:
    """Every sample of the server's /metrics, labels dropped (one model a server)."""
    out: dict[str, float] = {}
    for line in httpx.get(p.url + "/metrics", headers=_HEADERS, timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name.split("{")[0]] = out.get(name.split("{")[0], 0.0) + float(value)
    return out


def _settled(servers: list[Proc]) -> list[dict[str, float]]:
    """The servers' /metrics once their engines' reported totals (every 0.5 s) stop changing."""
    last = [_metrics(s) for s in servers]
    while True:
        time.sleep(0.6)
        now = [_metrics(s) for s in servers]
        if [m.get("engine:prefix_cache_queries_total") for m in now] == \
                [m.get("engine:prefix_cache_queries_total") for m in last]:
            return now
        last = now


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choices(WORDS, k=words))


async def _send(client: httpx.AsyncClient, url: str, args: argparse.Namespace, prompt: str,
                max_tokens: int) -> Result:
    body = {"model": Path(args.model).name, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}
    return await _one(client, url, body)


def _client() -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=httpx.Timeout(3600, connect=30), headers=_HEADERS,
                             limits=httpx.Limits(max_connections=1000, max_keepalive_connections=256))


async def _mixed_load(url: str, args: argparse.Namespace) -> dict:
    """Decoders streaming while long prompts arrive; their latencies apart."""
    rng = random.Random(args.seed)
    async with _client() as client:
        decoders = [asyncio.create_task(_send(client, url, args, _text(rng, 8), args.decode_len))
                    for _ in range(args.decoders)]
        await asyncio.sleep(args.long_delay)  # the decoders are decoding
        longs, start = [], time.perf_counter()
        for _ in range(args.long_prompts):
            longs.append(asyncio.create_task(_send(client, url, args, _text(rng, args.long_len), args.long_output)))
            await asyncio.sleep(rng.expovariate(args.long_rate))
        dec, lng = await asyncio.gather(*decoders), await asyncio.gather(*longs)
        duration = time.perf_counter() - start
    ok_dec, ok_long = [r for r in dec if r.ok], [r for r in lng if r.ok]
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok_dec if r.output_tokens > 1]
    return {"failed": len(dec) + len(lng) - len(ok_dec) - len(ok_long),
            "errors": sorted({r.error for r in dec + lng if not r.ok})[:3],
            "decoders": {"itl": _summary([x for r in ok_dec for x in r.itl]), "tpot": _summary(tpot),
                         "ttft": _summary([r.ttft for r in ok_dec])},
            "long_prompts": {"ttft": _summary([r.ttft for r in ok_long]), "e2e": _summary([r.e2e for r in ok_long]),
                             "mean_prompt_tokens": round(sum(r.input_tokens for r in ok_long) / max(1, len(ok_long)))},
            "long_phase_s": round(duration, 3)}


def run_pd(args: argparse.Namespace, logs: Path) -> dict:
    common = shlex.split(args.server_args)
    out = {}
    started: list[Proc] = []
    try:
        server = Proc("serve", ["--model", args.model, *common], logs, "colocated").wait(_healthy)
        gw = Proc("gateway", ["--worker-urls", server.url, "--policy", "round_robin"], logs, "colocated-gateway")
        started += [server, gw]
        gw.wait(_workers_ready(1))
        out["colocated"] = asyncio.run(_mixed_load(gw.url, args))
    finally:
        for p in reversed(started):
            p.stop()
    started = []
    try:
        port = _free_port()
        pd = ["--disaggregation-transfer-backend", args.transfer_backend]
        prefill = Proc("serve", ["--model", args.model, *common, *pd, "--disaggregation-mode", "prefill",
                                 "--disaggregation-bootstrap-port", str(port)], logs, "prefill")
        decode = Proc("serve", ["--model", args.model, *common, *pd, "--disaggregation-mode", "decode"], logs, "decode")
        started += [prefill, decode]
        prefill.wait(_healthy)
        decode.wait(_healthy)
        gw = Proc("gateway", ["--pd-disaggregation", "--prefill", prefill.url, str(port), "--decode", decode.url,
                              "--policy", "round_robin"], logs, "pd-gateway")
        started.append(gw)
        gw.wait(_workers_ready(2))
        out["pd"] = asyncio.run(_mixed_load(gw.url, args))
        (m,) = _settled([decode])
        out["pd"]["kv_transfer"] = {k: m.get(f"engine:kv_transfer_{k}_total", 0.0)
                                    for k in ("pages", "bytes", "pages_reused", "failed")}
    finally:
        for p in reversed(started):
            p.stop()
    return out


async def _tenants(url: str, args: argparse.Namespace, seed: int) -> dict:
    rng = random.Random(seed)
    prefixes = [f"Tenant {rng.randrange(10**9)}: {_text(rng, args.prefix_len)}\n" for _ in range(args.tenants)]
    prompts = []
    for turn in range(args.turns):  # every tenant once a turn, in a random order (no stride round robin follows)
        prompts += rng.sample([p + f"Question {turn}: {_text(rng, 6)}?" for p in prefixes], len(prefixes))
    gate = asyncio.Semaphore(args.concurrency)
    async with _client() as client:
        async def one(prompt: str) -> Result:
            async with gate:
                return await _send(client, url, args, prompt, args.tenant_output)
        start = time.perf_counter()
        results = await asyncio.gather(*(one(p) for p in prompts))
        duration = time.perf_counter() - start
    ok = [r for r in results if r.ok]
    tokens = sum(r.input_tokens + r.output_tokens for r in ok)
    return {"requests": len(prompts), "failed": len(results) - len(ok), "duration_s": round(duration, 3),
            "request_throughput": round(len(ok) / duration, 3), "total_token_throughput": round(tokens / duration, 2),
            "ttft": _summary([r.ttft for r in ok])}


def run_gateway(args: argparse.Namespace, logs: Path) -> dict:
    out = {}
    for n in args.replicas:
        servers = [Proc("serve", ["--model", args.model, *shlex.split(args.server_args)], logs, f"replica{n}-{i}")
                   for i in range(n)]
        try:
            for s in servers:
                s.wait(_healthy)
            for k, policy in enumerate(("round_robin", "cache_aware")):
                extra = ["--worker-warmup-secs", "0", "--worker-warmup-divert-every", "0"] \
                    if policy == "cache_aware" else []
                gw = Proc("gateway", ["--worker-urls", *(s.url for s in servers), "--policy", policy, *extra],
                          logs, f"gateway{n}-{policy}")
                try:
                    gw.wait(_workers_ready(n))
                    before = _settled(servers)
                    result = asyncio.run(_tenants(gw.url, args, args.seed + 100 * n + k))
                    after = _settled(servers)
                finally:
                    gw.stop()
                queries = sum(a["engine:prefix_cache_queries_total"] - b["engine:prefix_cache_queries_total"]
                              for a, b in zip(after, before))
                hits = sum(a["engine:prefix_cache_hits_total"] - b["engine:prefix_cache_hits_total"]
                           for a, b in zip(after, before))
                result["prefix_cache_hit_rate"] = round(hits / queries, 4) if queries else 0.0
                out.setdefault(f"{n}_replicas", {})[policy] = result
        finally:
            for s in servers:
                s.stop()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--part", choices=["pd", "gateway", "both"], default="both")
    p.add_argument("--server-args", default="--max-model-len 1024 --num-pages 512", help="flags every `engine serve` gets")
    p.add_argument("--transfer-backend", default="tcp")
    p.add_argument("--decoders", type=int, default=4)
    p.add_argument("--decode-len", type=int, default=48)
    p.add_argument("--long-prompts", type=int, default=6)
    p.add_argument("--long-len", type=int, default=300, help="words of each long prompt")
    p.add_argument("--long-output", type=int, default=2)
    p.add_argument("--long-rate", type=float, default=2.0, help="long prompts per second (Poisson)")
    p.add_argument("--long-delay", type=float, default=0.5, help="seconds the decoders run before the first")
    p.add_argument("--replicas", type=int, nargs="+", default=[2, 4])
    p.add_argument("--tenants", type=int, default=5)
    p.add_argument("--prefix-len", type=int, default=100, help="words of each tenant's prefix")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--tenant-output", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--machine", default=None, help="how to name the machine in the result (default: detected)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if not math.isfinite(args.long_rate) or args.long_rate <= 0:
        p.error("--long-rate must be a positive number")
    result = {"benchmark": "pd_vs_colocated", "model": Path(args.model).name, "commit": commit(),
              "machine": args.machine or _machine(), "args": {k: v for k, v in vars(args).items() if k != "json"}}
    with tempfile.TemporaryDirectory(prefix="pd-bench-") as tmp:
        if args.part in ("pd", "both"):
            result["pd_vs_colocated"] = run_pd(args, Path(tmp))
        if args.part in ("gateway", "both"):
            result["gateway"] = run_gateway(args, Path(tmp))
    print(json.dumps(result, indent=2))
    if args.json:
        write_result(args.json, result)


def _machine() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return f"{torch.cuda.get_device_name(0)}, {platform.node()}"
    except ImportError:
        pass
    return f"CPU, {os.cpu_count()} cores, {platform.node()}"


if __name__ == "__main__":
    main()
