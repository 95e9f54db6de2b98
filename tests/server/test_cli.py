"""The `engine` console script as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def run_engine(*args: str, env_extra: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "engine.server.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_generate_with_the_embedded_default_model(tmp_path):
    res = run_engine("generate", "--prompt", "def f(x):", "--max-tokens", "5", "--ignore-eos",
                     env_extra={"ENGINE_CACHE_DIR": str(tmp_path)})
    assert res.returncode == 0, res.stderr
    assert "RANDOM weights" in res.stdout
    assert "(5 tokens, finish_reason=length)" in res.stderr
    assert any(p.name.startswith("default-qwen3-") for p in tmp_path.iterdir())


def test_generate_trained_model_is_greedy_and_repeatable(tiny_qwen3):
    args = ("generate", "--model", str(tiny_qwen3), "--prompt", "import os\nimport ", "--max-tokens", "8")
    first, second = run_engine(*args), run_engine(*args)
    assert first.returncode == 0, first.stderr
    assert first.stdout == second.stdout
    assert first.stdout.startswith("import os\nimport ")


def test_plugins_reports_families_and_refusals(tiny_qwen3):
    res = run_engine("plugins", "--model", str(tiny_qwen3))
    assert res.returncode == 0, res.stderr
    assert "Platform: cpu" in res.stdout
    for family in ("attention", "moe", "linear", "norm", "sampling", "model"):
        assert f"\n{family}" in res.stdout
    assert "selects Qwen3ForCausalLM" in res.stdout
    assert "Blocks of Qwen3ForCausalLM" in res.stdout
    assert any(line.split()[:1] == ["attention,"] and line.endswith("attention backend native")
               for line in res.stdout.splitlines())
    assert any(line.split()[:1] == ["RMSNorm,"] and line.endswith("norm backend native")
               for line in res.stdout.splitlines())


def test_plugins_says_what_serves_each_deepseek_v4_block(shared_dir):
    res = run_engine("plugins", "--model", str(shared_dir / "models" / "tiny-dsv4-py"), "--moe-backend", "native")
    assert res.returncode == 0, res.stderr
    lines = res.stdout[res.stdout.index("Blocks of DeepseekV4ForCausalLM"):].splitlines()
    served = {line.split("  ")[1].strip(): line.strip().split("  ")[-1].strip() for line in lines[1:] if line.strip()}
    assert any("indexer top-k" in block and how == "v4_attention backend native" for block, how in served.items())
    assert any("experts" in block and how == "moe backend native" for block, how in served.items())
    assert any("projections" in block and how == "linear backend native" for block, how in served.items())
    assert any("RMSNorms" in block and how == "norm backend native" for block, how in served.items())


def test_explicit_backend_that_cannot_run_fails_with_reasons(tiny_qwen3):
    res = run_engine("generate", "--model", str(tiny_qwen3), "--prompt", "x", "--attention-backend", "nope")
    assert res.returncode != 0
    assert "'nope' is not registered" in res.stderr and "native" in res.stderr


@pytest.mark.slow
def test_bench_offline_reports_throughput(tiny_qwen3, tmp_path):
    out = tmp_path / "bench.json"
    res = run_engine("bench", "offline", "--model", str(tiny_qwen3), "--num-seqs", "6", "--min-len", "10",
                     "--max-len", "30", "--json", str(out))
    assert res.returncode == 0, res.stderr
    result = json.loads(out.read_text())
    assert result["num_seqs"] == 6 and result["output_tokens_per_s"] > 0
    assert 60 <= result["output_tokens"] <= 180  # ignore_eos: every sequence runs its drawn length


def test_gateway_keeps_its_defaults_and_passes_every_other_flag_through(monkeypatch, capsys):
    from engine.server import gateway
    from engine.server.cli import build_parser

    argv = ["gateway", "--worker-urls", "http://127.0.0.1:1", "http://127.0.0.1:2", "--cache-threshold", "0.5",
            "--prefill", "http://127.0.0.1:3", "8998", "--policy", "round_robin"]
    args, unknown = build_parser().parse_known_args(argv)
    cmd = gateway.smg_argv(args, unknown)
    assert cmd[1:4] == ["-m", "smg", "launch"]
    flags = dict(zip(cmd[4:], cmd[5:]))
    assert flags["--host"] == flags["--prometheus-host"] == "127.0.0.1"
    assert flags["--policy"] == "round_robin"
    assert cmd[-5:] == ["--cache-threshold", "0.5", "--prefill", "http://127.0.0.1:3", "8998"]

    monkeypatch.setattr(gateway.importlib.util, "find_spec", lambda name: None)
    assert gateway.run_gateway(args, unknown) == 2  # smg missing: no exec, a hint instead
    assert "pip install 'engine[gateway]'" in capsys.readouterr().err

