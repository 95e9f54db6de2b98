"""DeepSeek-V4 behind `engine serve` and `engine generate`, as any other family: the same tokens as LLM;
and served with data-parallel attention over 2 processes (gloo), concurrent requests spread over
both ranks, stop strings ended on the rank that runs the request."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

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


@pytest.fixture(scope="module")
def server(dsv4, tmp_path_factory):
    server = LiveServer(str(dsv4), "--max-model-len", "1024",  # V4's tools section is 530 tokens here
                        log=tmp_path_factory.mktemp("logs") / "dsv4.log").wait_ready()
    yield server
    server.stop()


def test_served_completions_equal_the_offline_engine(server, expected):
    body = {"model": server.model_name, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    res = httpx.post(server.url + "/v1/completions", json=body, headers=server.headers, timeout=120)
    assert res.status_code == 200, res.text
    assert res.json()["choices"][0]["text"] == expected
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True},
                      headers=server.headers, timeout=120) as stream:
        chunks = [line for line in stream.iter_lines() if line.startswith("data: {")]
    assert "".join(json.loads(c[6:])["choices"][0]["text"] for c in chunks) == expected


def test_chat_goes_through_the_v4_encoding_and_reads_dsml_calls(server):
    """No chat template in the checkpoint: its prompts are DeepSeek-V4's encoding (server/deepseek_v4_chat.py),
    and the DSML tool-call parser is found from it; a forced call comes back as a call."""
    res = httpx.post(server.url + "/tokenize", headers=server.headers, timeout=60,
                     json={"model": server.model_name, "messages": [{"role": "user", "content": "hi"}]})
    assert res.status_code == 200, res.text
    ids = res.json()["tokens"]
    res = httpx.post(server.url + "/detokenize", headers=server.headers, timeout=60,
                     json={"model": server.model_name, "tokens": ids})
    assert res.json()["prompt"] == "<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜></think>"
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
        "additionalProperties": False}}}

    def ask(seed: int) -> dict:
        body = {"model": server.model_name, "messages": [{"role": "user", "content": "Weather in Oslo?"}],
                "tools": [tool], "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 200,
                "temperature": 1.0, "seed": seed}
        res = httpx.post(server.url + "/v1/chat/completions", json=body, headers=server.headers, timeout=120)
        assert res.status_code == 200, res.text
        return res.json()["choices"][0]

    with ThreadPoolExecutor(3) as pool:
        choices = list(pool.map(ask, range(3)))
    for choice in choices:  # the tiny model may write a string until max_tokens: the call is cut short then
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather" and choice["finish_reason"] in ("tool_calls", "length")
    done = [c for c in choices if c["finish_reason"] == "tool_calls"]
    assert done, choices
    for choice in done:  # the block's end is no content
        assert choice["message"]["content"] is None, choice
        assert set(json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"])) == {"city"}


def test_generate_command_equals_the_offline_engine(dsv4, expected):
    res = run_engine("generate", "--model", str(dsv4), "--prompt", PROMPT, "--max-tokens", "12", "--ignore-eos",
                     "--temperature", "0")
    assert res.returncode == 0, res.stderr
    assert res.stdout == PROMPT + expected + "\n"


def test_served_under_data_parallel_attention_equals_the_offline_engine(dsv4, tmp_path):
    prompts = [PROMPT, "class Stack:\n    ", "import os\n", "# sort a list\n"]
    llm = LLM(str(dsv4), progress=False, max_model_len=512)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    texts = [o.outputs[0].text for o in llm.generate(prompts, greedy)]
    stops = [t[4:7] for t in texts]  # each ends inside its output, on whichever rank runs it
    stopped = [o.outputs[0].text for o in llm.generate(
        prompts, [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[s]) for s in stops])]
    assert all(len(s) == 3 for s in stops) and all(len(a) < len(b) for a, b in zip(stopped, texts))
    server = LiveServer(str(dsv4), "--max-model-len", "512", "--tensor-parallel-size", "2", "--data-parallel-size",
                        "2", "--enable-dp-attention", "--expert-parallel", log=tmp_path / "dp.log").wait_ready()
    try:
        def complete(i: int) -> str:
            body = {"model": server.model_name, "prompt": prompts[i % 4], "max_tokens": 12, "temperature": 0,
                    "ignore_eos": True, **({"stop": [stops[i % 4]]} if i >= 4 else {})}
            res = httpx.post(server.url + "/v1/completions", json=body, headers=server.headers, timeout=120)
            assert res.status_code == 200, res.text
            return res.json()["choices"][0]["text"]

        with ThreadPoolExecutor(8) as pool:
            assert list(pool.map(complete, range(8))) == texts + stopped
        assert httpx.get(server.url + "/health", timeout=5).status_code == 200
    finally:
        assert server.stop() == 0
