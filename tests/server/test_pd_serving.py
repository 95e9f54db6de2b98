"""Prefill/decode disaggregation served: a prefill and a decode `engine serve` behind
`engine gateway --pd-disaggregation` (SGLang's smg drives SGLang's bootstrap protocol), on
tiny-qwen3-py and tiny-dsv4-py over the tcp transport and over mooncake where its Transfer Engine
loads, tiny-qwen3-py over nixl where installed and over cuda_ipc on a GPU (two engine processes
sharing it).
Greedy answers equal a single engine's; bootstrap fields are checked at the edge and a room in
use is refused on the prefill server; a decode whose prefill never sends computes the prompt itself
(counted) and answers as a single engine does; a killed prefill fails its requests through the
gateway with a clear error while the decode server holds no page and keeps serving."""

from __future__ import annotations

import importlib.util
import random
import time

import httpx
import pytest

pytest.importorskip("smg", reason="engine gateway needs the gateway extra: pip install 'engine[gateway]'")
import openai  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.plugins.mooncake_kv import mooncake_kv_reasons  # noqa: E402
from live_gateway import LiveGateway  # noqa: E402
from live_server import API_KEY, LiveServer, free_port  # noqa: E402

MAX_TOKENS = 6
NO_MOONCAKE = mooncake_kv_reasons(None)
MOONCAKE = pytest.mark.skipif(bool(NO_MOONCAKE), reason="; ".join(NO_MOONCAKE))
TIMEOUT_S = 4  # --disaggregation-timeout: how long a room waits for its other side
PROMPTS = ["def fibonacci(n):", "import os\nimport"]


@pytest.fixture(scope="module", ids=lambda p: "-".join(p), params=[
    ("tiny-qwen3-py", "tcp"), ("tiny-dsv4-py", "tcp"),
    pytest.param(("tiny-qwen3-py", "nixl"), marks=pytest.mark.skipif(
        importlib.util.find_spec("nixl") is None, reason="nixl is not installed (pip install 'engine[nixl]')")),
    pytest.param(("tiny-qwen3-py", "mooncake"), marks=MOONCAKE),
    pytest.param(("tiny-dsv4-py", "mooncake"), marks=MOONCAKE),
    pytest.param(("tiny-qwen3-py", "cuda_ipc"), marks=pytest.mark.gpu)])
def pd(request, shared_dir, tmp_path_factory):
    name, transport = request.param
    model = str(shared_dir / "models" / name)
    logs = tmp_path_factory.mktemp("pd")
    port = free_port()
    common = ("--max-model-len", "512", "--disaggregation-timeout", str(TIMEOUT_S),
              "--disaggregation-transfer-backend", transport,
              *(("--kv-cache-memory", "1GiB") if transport == "cuda_ipc" else ()))  # two engines share the GPU
    prefill = LiveServer(model, *common, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port",
                         str(port), log=logs / "prefill.log")
    decode = LiveServer(model, *common, "--disaggregation-mode", "decode", log=logs / "decode.log")
    servers = [prefill.wait_ready(), decode.wait_ready()]
    gateway = LiveGateway("--pd-disaggregation", "--prefill", prefill.url, str(port), "--decode", decode.url,
                          "--policy", "round_robin", log=logs / "gateway.log")
    gateway.wait_ready(2)
    llm = LLM(model, max_model_len=512, warmup=False, progress=False)
    want = [o.outputs[0].text for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))]
    yield prefill, decode, gateway, port, want
    gateway.stop()
    for s in servers:
        s.stop()


def _used_tokens(server: LiveServer, within: float = 3.0) -> int:
    """KV tokens the server's requests hold, once it reports none or ``within`` seconds passed
    (the engine reports its gauges with each step's outputs and every 0.5 s)."""
    deadline = time.monotonic() + within
    while True:
        r = httpx.get(server.url + "/v1/loads", headers=server.headers, timeout=5)
        used = r.json()["loads"][0]["num_used_tokens"]
        if used == 0 or time.monotonic() > deadline:
            return used
        time.sleep(0.1)


def test_answers_through_prefill_and_decode_equal_a_single_engine(pd):
    prefill, decode, gateway, _, want = pd
    assert {w["worker_type"] for w in gateway.workers()} == {"prefill", "decode"}
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    model = decode.model_name
    both = client.completions.create(model=model, prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0)
    assert [c.text for c in sorted(both.choices, key=lambda c: c.index)] == want
    stream = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
                                       stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == want[0]
    messages = [{"role": "user", "content": "Hello"}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    chunks = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
    assert _used_tokens(decode) == 0 and _used_tokens(prefill) == 0


def test_a_repeated_prompt_moves_only_the_pages_the_decode_lacks(pd):
    """The decode server's /metrics count its transfers: a prompt sent again meets its prefix cache,
    so fewer bytes move, and the answer is the same."""
    _, decode, gateway, _, _ = pd
    prompt = " ".join(f"item{i} = {i * i}" for i in range(24))  # several pages of tokens
    body = {"model": decode.model_name, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    answers, moved = [], []
    for _ in range(2):
        before = decode.metrics()
        r = httpx.post(gateway.url + "/v1/completions", headers=gateway.headers, json=body, timeout=120)
        assert r.status_code == 200, r.text
        answers.append(r.json()["choices"][0]["text"])
        after = _settled_metrics(decode, before)
        moved.append({k: after[f"engine:kv_transfer_{k}_total"] - before.get(f"engine:kv_transfer_{k}_total", 0)
                      for k in ("pages", "bytes", "pages_reused")})
    assert answers[0] == answers[1]
    assert moved[0]["pages_reused"] == 0 < moved[1]["pages_reused"]
    assert moved[0]["pages"] == moved[1]["pages"] + moved[1]["pages_reused"]
    assert 0 < moved[1]["bytes"] < moved[0]["bytes"]


def _settled_metrics(server: LiveServer, before: dict[str, float], counter: str = "engine:kv_transfer_total",
                     within: float = 3.0) -> dict[str, float]:
    """/metrics once ``counter`` counted the transfer the last request made (the engine reports its
    totals with each step's outputs and every 0.5 s)."""
    deadline = time.monotonic() + within
    while True:
        m = server.metrics()
        if m.get(counter, 0) > before.get(counter, 0) or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


@pytest.mark.parametrize("fields,param", [
    ({}, "bootstrap_host"),
    ({"bootstrap_host": "10.9.8.7"}, "bootstrap_host"),
    ({"bootstrap_port": 0}, "bootstrap_port"),
    ({"bootstrap_room": -1}, "bootstrap_room"),
    ({"bootstrap_room": "7"}, "bootstrap_room"),
    ({"bootstrap_room": [1, 2]}, "bootstrap_room"),
    ({"bootstrap_room": True}, "bootstrap_room"),
    ({"bootstrap_room": 2**63}, "bootstrap_room"),
    ({"bootstrap_port": 8998.0}, "bootstrap_port"),
    ({"bootstrap_host": "127.0.0.1\x00.evil"}, "bootstrap_host"),
    ({"kv_transfer_params": {"do_remote_prefill": True}}, "kv_transfer_params"),  # vLLM's, incomplete
])
def test_bootstrap_fields_are_checked_before_the_engine(pd, fields, param):
    _, decode, _, port, _ = pd
    body = {"prompt": "x", "max_tokens": 1}
    if fields:
        body |= {"bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": 5} | fields
    r = httpx.post(decode.url + "/v1/completions", json=body, headers=decode.headers, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_a_room_in_use_on_the_prefill_is_refused(pd):
    """A client must not take over another request's room: the prefill server keeps a published
    room until it is fetched or its timeout passes, and refuses it to anyone else meanwhile."""
    prefill, _, _, port, _ = pd
    body = {"prompt": PROMPTS[1], "max_tokens": 1, "bootstrap_host": "127.0.0.1", "bootstrap_port": port,
            "bootstrap_room": random.randrange(2**63)}
    first = httpx.post(prefill.url + "/v1/completions", json=body, headers=prefill.headers, timeout=60)
    assert first.status_code == 200, first.text
    again = httpx.post(prefill.url + "/v1/completions", json=body | {"prompt": "import sys"},
                       headers=prefill.headers, timeout=60)
    assert again.status_code == 400, again.text
    assert again.json()["error"]["param"] == "bootstrap_room" and "in use" in again.json()["error"]["message"]
    assert _used_tokens(prefill) == 0


def test_a_decode_whose_prefill_never_sends_computes_the_prompt_itself(pd):
    """The room is unknown to the prefill server, which says so after its timeout: the decode server
    counts the failed transfer, computes the prompt and answers as a single engine does."""
    _, decode, _, port, want = pd
    body = {"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0, "bootstrap_host": "127.0.0.1",
            "bootstrap_port": port, "bootstrap_room": random.randrange(2**63)}
    before = decode.metrics()
    r = httpx.post(decode.url + "/v1/completions", json=body, headers=decode.headers, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == want[0]
    failed = "engine:kv_transfer_failed_total"
    assert _settled_metrics(decode, before, failed)[failed] == before.get(failed, 0) + 1
    assert _used_tokens(decode) == 0


def test_a_killed_prefill_fails_requests_and_the_decode_serves_on(pd):
    """Runs last in this module: it kills the prefill server."""
    prefill, decode, gateway, _, _ = pd
    prefill.proc.kill()
    prefill.proc.wait()
    r = httpx.post(gateway.url + "/v1/completions", headers=gateway.headers, timeout=60,
                   json={"model": decode.model_name, "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS})
    assert r.status_code >= 500 and "error" in r.json()
    assert _used_tokens(decode) == 0
    assert httpx.get(decode.url + "/health", timeout=5).status_code == 200
