"""`engine bench serve` against a live server: every request counted, shared prefixes hit the cache."""

from __future__ import annotations

import json
import subprocess
import sys


def _bench(server, tmp_path, *args) -> dict:
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "engine.server.cli", "bench", "serve", "--url", server.url,
                           "--api-key", server.api_key, "--json", str(out), *args],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "TTFT (ms)" in proc.stdout and "output token throughput" in proc.stdout
    assert "HTTP Request" not in proc.stderr  # quiet: no log line per request
    prompts = int(args[args.index("--num-prompts") + 1])
    assert "first tokens: 100%" in proc.stderr and f"{prompts}/{prompts}" in proc.stderr
    return json.loads(out.read_text())


def test_random_dataset_all_at_once(tiny_server, tmp_path):
    r = _bench(tiny_server, tmp_path, "--num-prompts", "6", "--input-len", "20", "--output-len", "5")
    assert (r["completed"], r["failed"]) == (6, 0)
    assert (r["input_tokens"], r["output_tokens"]) == (120, 30)
    assert r["ttft"]["p50_ms"] > 0 and r["e2e"]["p99_ms"] >= r["e2e"]["p50_ms"] >= r["ttft"]["p50_ms"]


def test_shared_prefix_dataset_hits_the_prefix_cache(tiny_server, tmp_path):
    before = tiny_server.metrics()
    r = _bench(tiny_server, tmp_path, "--dataset", "shared-prefix", "--num-prompts", "6", "--num-prefixes", "2",
               "--prefix-len", "64", "--input-len", "10", "--output-len", "3", "--max-concurrency", "1",
               "--request-rate", "100", "--bench-seed", "7")
    assert r["completed"] == 6 and r["input_tokens"] == 6 * 74
    hits = tiny_server.metrics()["engine:prefix_cache_hits_total"] - before["engine:prefix_cache_hits_total"]
    assert hits == 4 * 64  # one at a time: all but the first of each prefix find it whole
