"""benchmarks/page_checksums.py at a tiny size: every candidate hash is timed and the JSON says so."""

from __future__ import annotations

import json
import subprocess
import sys

from benchmark_script import BENCHMARKS


def test_the_checksum_benchmark_times_every_candidate(tmp_path):
    out = tmp_path / "result.json"
    res = subprocess.run([sys.executable, str(BENCHMARKS / "page_checksums.py"), "--sizes", "4096", "--bytes", "65536",
                          "--repeats", "1", "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    rates = json.loads(out.read_text())["gb_per_s_one_core"]["4096"]
    assert {"blake2b-128", "sha256", "xxh3-128", "blake3-128", "crc32"} <= set(rates) and min(rates.values()) > 0
