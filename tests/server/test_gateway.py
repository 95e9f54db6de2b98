"""`engine gateway` (SGLang's smg) in front of two `engine serve` replicas of tiny-qwen3-py: the
gateway registers them as SGLang workers, spreads OpenAI requests round robin, keeps a repeated
prefix on one replica with cache-aware routing (so a shared-prefix multi-tenant workload hits the
replicas' prefix caches more often than under round robin, read from their /metrics), and routes
around a replica that was killed."""

from __future__ import annotations

import random
import time

import httpx
import pytest

pytest.importorskip("smg", reason="engine gateway needs the gateway extra: pip install 'engine[gateway]'")
import openai  # noqa: E402

from live_gateway import LiveGateway  # noqa: E402
from live_server import API_KEY, LiveServer  # noqa: E402

MAX_TOKENS = 4


@pytest.fixture(scope="module")
def replicas(tiny_qwen3, tmp_path_factory):
    logs = tmp_path_factory.mktemp("replicas")
    started = [LiveServer(str(tiny_qwen3), "--max-model-len", "512", log=logs / f"replica{i}.log") for i in range(2)]
    servers = [s.wait_ready() for s in started]
    yield servers
    for s in servers:
        s.stop()


def _gateway(replicas, tmp_path_factory, *args: str):
    urls = [r.url for r in replicas]
    gw = LiveGateway("--worker-urls", *urls, *args, log=tmp_path_factory.mktemp("gateway") / "gateway.log")
    try:
        gw.wait_ready(len(urls))
    except Exception:
        gw.stop()
        raise
    return gw


@pytest.fixture(scope="module")
def round_robin(replicas, tmp_path_factory):
    # fast health probes, so the replica test_killed_replica kills is seen within seconds
    gw = _gateway(replicas, tmp_path_factory, "--policy", "round_robin", "--health-check-interval-secs", "1",
                  "--health-failure-threshold", "1")
    yield gw
    gw.stop()


@pytest.fixture(scope="module")
def cache_aware(replicas, tmp_path_factory):
    # no warm-up diversions: a cold replica would otherwise be offered some cache hits on purpose
    gw = _gateway(replicas, tmp_path_factory, "--worker-warmup-secs", "0", "--worker-warmup-divert-every", "0")
    yield gw
    gw.stop()


def _finished(server: LiveServer) -> int:
    return sum(v for k, v in server.metrics().items() if k.startswith("engine:request_success_total"))


def _client(gw: LiveGateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def _stream_text(stream) -> str:
    return "".join((c.choices[0].text if hasattr(c.choices[0], "text") else c.choices[0].delta.content or "")
                   for c in stream if c.choices)


def test_workers_are_registered_as_sglang_workers(replicas, round_robin):
    by_url = {w["url"]: w for w in round_robin.workers()}
    assert set(by_url) == {r.url for r in replicas}
    for w in by_url.values():
        assert (w["runtime_type"], w["worker_type"]) == ("sglang", "regular")
        assert w["labels"]["max_running_requests"] == "256"      # from the worker's /server_info
        assert w["labels"]["architectures"] == '["Qwen3ForCausalLM"]'  # from its /model_info
    r = replicas[0]
    loads = httpx.get(r.url + "/v1/loads", headers=r.headers, timeout=5).json()
    (rank,) = loads["loads"]
    assert rank["max_total_num_tokens"] > 0 and 0.0 <= rank["token_usage"] <= 1.0


def test_round_robin_spreads_completions_and_chats_over_both_replicas(replicas, round_robin):
    direct = openai.OpenAI(base_url=replicas[0].url + "/v1", api_key=API_KEY, max_retries=0)
    model, prompt, messages = replicas[0].model_name, "def fibonacci(n):", [{"role": "user", "content": "Hello"}]
    want_text = direct.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    want_chat = direct.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    before = [_finished(r) for r in replicas]

    client = _client(round_robin)
    text = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    text_stream = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True)
    assert _stream_text(text_stream) == want_text.choices[0].text
    chat_stream = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS,
                                                 temperature=0, stream=True)
    assert _stream_text(chat_stream) == want_chat.choices[0].message.content
    assert text.choices[0].text == want_text.choices[0].text
    assert chat.choices[0].message.content == want_chat.choices[0].message.content
    assert [_finished(r) - b for r, b in zip(replicas, before)] == [2, 2]


def test_cache_aware_keeps_a_repeated_prefix_on_one_replica(replicas, cache_aware):
    client = _client(cache_aware)
    tenants = ["You are a careful assistant for the billing team. " * 8,
               "Summarise the following kernel log for an engineer on call. " * 8]
    for tenant in tenants:
        served = []
        for question in ("What changed?", "Who is affected?", "What next?"):
            before = [_finished(r) for r in replicas]
            client.completions.create(model=replicas[0].model_name, prompt=tenant + question,
                                      max_tokens=MAX_TOKENS, temperature=0)
            served.append(next(i for i, (r, b) in enumerate(zip(replicas, before)) if _finished(r) > b))
        assert len(set(served)) == 1, f"one tenant's requests went to replicas {served}"


def _prefix_cache(replicas) -> tuple[float, float]:
    """Prompt tokens looked up and found in the replicas' prefix caches, summed, once the engines'
    last reported totals (sent with each step's outputs and every 0.5 s) stopped changing."""
    def read():
        ms = [r.metrics() for r in replicas]
        return (sum(m["engine:prefix_cache_queries_total"] for m in ms),
                sum(m["engine:prefix_cache_hits_total"] for m in ms))
    last = read()
    while True:
        time.sleep(0.6)
        now = read()
        if now == last:
            return now
        last = now


def _hit_rate(replicas, gw, tenants: int, turns: int) -> float:
    """Tenants with long prefixes of their own (fresh each call) asking in turn, one request at a
    time: the fraction of the prompt tokens looked up that the replicas' caches held."""
    words = ["alpha", "ledger", "kernel", "invoice", "river", "socket", "margin", "plasma", "harbor", "quota"]
    prefixes = [f"Tenant {random.randrange(10**9)}: " + " ".join(random.choices(words, k=80)) + "\n"
                for _ in range(tenants)]
    client = _client(gw)
    queries, hits = _prefix_cache(replicas)
    for turn in range(turns):
        for prefix in prefixes:
            client.completions.create(model=replicas[0].model_name, prompt=prefix + f"Question {turn}?",
                                      max_tokens=1, temperature=0)
    queries_after, hits_after = _prefix_cache(replicas)
    return (hits_after - hits) / (queries_after - queries)


def test_cache_aware_routing_hits_the_prefix_caches_more_than_round_robin(replicas, round_robin, cache_aware,
                                                                          seed):
    # 3 tenants over 2 replicas: round robin sends each tenant's turns to both replicas in turn
    # (each computes the prefix once); cache-aware keeps a tenant on one (computed once in all)
    rr = _hit_rate(replicas, round_robin, tenants=3, turns=4)
    ca = _hit_rate(replicas, cache_aware, tenants=3, turns=4)
    assert ca > rr + 0.1, f"cache-aware hit rate {ca:.2f}, round robin {rr:.2f}"


def test_killed_replica_is_routed_around(replicas, round_robin):
    """Runs last in this module: it kills replica 1."""
    client, model = _client(round_robin), replicas[0].model_name
    replicas[1].proc.kill()
    replicas[1].proc.wait()
    for _ in range(3):  # the gateway may still pick the dead replica; it retries on the other
        assert client.completions.create(model=model, prompt="import os", max_tokens=MAX_TOKENS,
                                         temperature=0).choices[0].text
    deadline = time.monotonic() + 30
    while next(w for w in round_robin.workers() if w["url"] == replicas[1].url)["is_healthy"]:
        assert time.monotonic() < deadline, "the gateway still calls the killed replica healthy"
        time.sleep(0.5)
    before = _finished(replicas[0])
    for _ in range(3):
        client.completions.create(model=model, prompt="import sys", max_tokens=MAX_TOKENS, temperature=0)
    assert _finished(replicas[0]) - before == 3
