"""DeepSeek-V4 behind `engine serve` and `engine generate`, as any other family: the same tokens as LLM."""

from __future__ import annotations

import json

import httpx
import pytest

from engine import LLM, SamplingParams
from live_server import LiveServer
from test_cli import run_engine

PROMPT = "def fibonacci(n):\n    "


@pytest.fixture(scope="module")
def dsv4(shared_dir):
    return shared_dir / "models" / "tiny-dsv4-py"


@pytest.fixture(scope="module")
def expected(dsv4) -> str:
    llm = LLM(str(dsv4), progress=False, max_model_len=512)
    return llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0].text


def test_served_completions_equal_the_offline_engine(dsv4, expected, tmp_path):
    server = LiveServer(str(dsv4), "--max-model-len", "512", log=tmp_path / "dsv4.log").wait_ready()
    try:
        body = {"model": server.model_name, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        res = httpx.post(server.url + "/v1/completions", json=body, headers=server.headers, timeout=120)
        assert res.status_code == 200, res.text
        assert res.json()["choices"][0]["text"] == expected
        with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True},
                          headers=server.headers, timeout=120) as stream:
            chunks = [line for line in stream.iter_lines() if line.startswith("data: {")]
        assert "".join(json.loads(c[6:])["choices"][0]["text"] for c in chunks) == expected
    finally:
        server.stop()


def test_generate_command_equals_the_offline_engine(dsv4, expected):
    res = run_engine("generate", "--model", str(dsv4), "--prompt", PROMPT, "--max-tokens", "12", "--ignore-eos",
                     "--temperature", "0")
    assert res.returncode == 0, res.stderr
    assert res.stdout == PROMPT + expected + "\n"
