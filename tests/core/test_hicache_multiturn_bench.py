"""benchmarks/hicache_multiturn.py end to end at tiny sizes on the CPU: every configuration runs the
same conversations, the tiers below the device raise the hit rate of later turns and report what
crossed them, and the JSON names the settings (its times say nothing of a GPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from benchmark_script import BENCHMARKS


def test_the_multiturn_benchmark_runs_every_configuration(shared_dir, tmp_path, run_seed):
    out = tmp_path / "result.json"
    cmd = [sys.executable, str(BENCHMARKS / "hicache_multiturn.py"), "--model", str(shared_dir / "models" / "tiny-qwen3-py"),
           "--device", "cpu", "--conversations", "4", "--turns", "3", "--system-len", "32", "--user-len", "16",
           "--answer-len", "4", "--page-size", "4", "--prefetch-threshold", "8", "--seed", str(run_seed % 1000),
           "--storage-dir", str(tmp_path / "storage"), "--bandwidth-bytes", str(16 << 20), "--json", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads(out.read_text())
    runs = {r["config"]: r for r in result["results"]}
    assert list(runs) == ["l1", "l1_l2", "l1_l2_l3"]
    assert result["working_set_tokens"] == 32 + 4 * 3 * (16 + 4) and result["load_bandwidth"] is None
    assert result["storage_bandwidth"]["write_gb_s"] > 0 and result["storage_bandwidth"]["read_gb_s"] > 0
    assert runs["l1"]["hicache"] is None
    assert runs["l1_l2"]["hicache"]["hit_tokens"]["l2"] > 0
    assert runs["l1_l2"]["hit_rate_later_turns"] > runs["l1"]["hit_rate_later_turns"]
    assert runs["l1_l2_l3"]["hicache"]["bytes_written"]["l3"] > 0 and list(Path(tmp_path / "storage").rglob("*.kv"))
    for r in runs.values():
        assert len(r["ttft_by_turn_s"]) == 3 and r["output_tokens_per_s"] > 0 and r["ttft_later_turns_vs_l1"] > 0
