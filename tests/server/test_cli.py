"""The `engine` console script as a user runs it."""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys

import pytest


def run_engine(*args: str, env_extra: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "engine.server.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_generate_with_the_embedded_default_model(tmp_path):
    res = run_engine("generate", "--prompt", "def f(x):", "--max-tokens", "5", "--ignore-eos", "--n", "2",
                     "--temperature", "1", "--cpu-threads", "1", env_extra={"ENGINE_CACHE_DIR": str(tmp_path)})
    assert res.returncode == 0, res.stderr
    assert "RANDOM weights" in res.stdout
    assert res.stderr.count("(5 tokens, finish_reason=length)") == 2
    assert any(p.name.startswith("default-qwen3-") for p in tmp_path.iterdir())
    assert "1 torch CPU threads" in res.stderr
    # the KV cache holds this prompt's two completions, not the 2GiB default
    pages = int(re.search(r"KV cache (\d+) pages of 16 tokens", res.stderr)[1])
    assert pages <= 2 * 2 + 1
    # the weight-loading bar ends its line: the next log line starts one of its own
    assert re.search(r"\n\S+ \S+ INFO engine.core.loader: read", res.stderr)


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


def test_plugins_on_a_v41_dir_refuses_the_triton_v4_attention_only_for_the_platform(tmp_path, shared_dir):
    """DeepSeek-V4.1 (CSA2 at ratios 1 and 2, entries and index keys shared across layers, the candidate
    filter): the Triton V4 attention asks nothing of the model it lacks, so where the platform is a GPU
    it serves it (tests/backends/test_cuda_dsv41.py shows that on one)."""
    from dsv41_random import KERNEL_SHAPE, random_v41_checkpoint, v41_config

    hf = {**v41_config([2, 2, 1, 1], [0, 2], [0, 2, 3], candidate=2, blocks=2, block_size=2), **KERNEL_SHAPE}
    path = random_v41_checkpoint(tmp_path / "v41", 0, hf, shared_dir / "models" / "tiny-dsv4-py")
    res = run_engine("plugins", "--model", str(path), "--moe-backend", "native")
    assert res.returncode == 0, res.stderr
    lines = res.stdout[res.stdout.index("\nv4_attention:"):].splitlines()[2:4]
    assert [line.split()[:3] for line in lines] == [["triton", "plugin", "cuda"], ["triton", "plugin", "rocm"]]
    for line, gpu in zip(lines, ("an NVIDIA GPU", "an AMD GPU")):
        assert line.split("refuses: ")[1] == f"needs {gpu} (the platform is cpu cpu (host CPU))"


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



def test_help_and_argument_errors_import_neither_torch_nor_the_server():
    probe = ("import sys\nfrom engine.server.cli import main\n"
             "for argv in (['--help'], ['serve', '--help'], ['generate', '--bogus']):\n"
             "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
             "print(sorted(m for m in ('torch', 'fastapi', 'uvicorn', 'httpx') if m in sys.modules))")
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().splitlines()[-1] == "[]"


def _parsers(parser, path=()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, (*path, name))
    yield path, parser


def test_every_flag_says_what_it_does_and_shows_its_default():
    from engine.server.cli import build_parser

    for path, parser in _parsers(build_parser()):
        text = " ".join(parser.format_help().split())
        for action in parser._actions:
            if not action.option_strings or action.dest == "help":
                continue
            assert action.help, f"engine {' '.join(path)} {action.option_strings[0]} has no help"
            if action.default not in (None, False, True, []) and "default" not in action.help:
                assert f"(default: {action.default})" in text, (path, action.option_strings[0])
    for argv in (["--log-level", "debug", "serve"], ["serve", "--log-level", "debug"],
                 ["--log-level", "error", "bench", "serve", "--log-level", "debug"]):
        assert build_parser().parse_args(argv).log_level == "DEBUG"
    assert build_parser().parse_args(["--log-level", "error", "serve"]).log_level == "ERROR"
    serve = dict(_parsers(build_parser()))[("serve",)]
    assert "(default: 8000)" in " ".join(serve.format_help().split())


def test_a_missing_model_is_one_line_and_a_hub_id_says_the_engine_does_not_download(tmp_path):
    res = run_engine("generate", "--model", str(tmp_path / "absent"), "--prompt", "x")
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert res.stderr.strip() == f"engine: error: model directory {tmp_path / 'absent'} does not exist"
    res = run_engine("serve", "--model", "acme/absent", "--port", "0",
                     env_extra={"HF_HUB_CACHE": str(tmp_path / "hub")})
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert "acme/absent" in res.stderr and "does not download" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_a_hub_id_resolves_from_the_local_hugging_face_cache(tiny_qwen3, tmp_path):
    repo = tmp_path / "hub" / "models--acme--tiny"
    snapshot = repo / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abc")
    for f in tiny_qwen3.iterdir():
        (snapshot / f.name).symlink_to(f)
    res = run_engine("plugins", "--model", "acme/tiny", env_extra={"HF_HUB_CACHE": str(tmp_path / "hub")})
    assert res.returncode == 0, res.stderr
    assert "selects Qwen3ForCausalLM" in res.stdout
    res = run_engine("plugins", "--model", "acme/tiny", env_extra={"HF_HOME": str(tmp_path)})
    assert res.returncode == 0 and "selects Qwen3ForCausalLM" in res.stdout, res.stderr


def test_a_port_in_use_fails_before_the_model_loads(tiny_qwen3):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        res = run_engine("serve", "--model", str(tiny_qwen3), "--port", str(port), timeout=120)
    assert res.returncode != 0
    assert f"cannot listen on 127.0.0.1:{port}" in res.stderr and "in use" in res.stderr
    assert "loading" not in res.stderr and "serving" not in res.stderr
