"""What one request may ask for is bounded: prompts x n, and the logprob values an answer carries.

Large answers are built off the event loop, so /health stays quick while one is built; the
memory of both processes stays within a stated bound through the largest allowed requests.
"""

from __future__ import annotations

import random
import threading
import time

import httpx

RSS_BOUND_MIB = 150  # growth of each process through the cases below
SEQ_CAP, ENTRY_CAP, MAX_N, MAX_LOGPROBS = 16, 20000, 4, 5  # the shared servers' limits (conftest)


class HealthProbe:
    """Polls /health in a thread while a request runs; records every status and the slowest answer."""

    def __init__(self, server) -> None:
        self.url = server.url + "/health"
        self.statuses: list[int] = []
        self.slowest = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        """Probes at least once, so a request answered before the first poll still gets a status."""
        with httpx.Client(timeout=30) as client:
            while True:
                t0 = time.monotonic()
                self.statuses.append(client.get(self.url).status_code)
                self.slowest = max(self.slowest, time.monotonic() - t0)
                if self._stop.wait(0.02):
                    return

    def __enter__(self) -> "HealthProbe":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def _post(server, body: dict) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", headers=server.headers, timeout=120,
                      json={"model": server.model_name, **body})


def _still_serves(server) -> None:
    r = _post(server, {"prompt": "def f(x):", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    assert httpx.get(server.url + "/health").status_code == 200


def _wait_idle(server, timeout: float = 10.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        if m["engine:num_requests_running"] == m["engine:num_requests_waiting"] == m["engine:num_requests_in_flight"] == 0:
            return m
        assert time.monotonic() < deadline, m
        time.sleep(0.1)


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 1000) for _ in range(n)]


def test_echo_logprobs_are_bounded_and_built_off_the_loop(tiny_server, seed):
    rng = random.Random(seed)
    rss0 = tiny_server.rss_mib()
    length = rng.randint(440, 500)
    # 4 prompts x n 4 x (length + 2) tokens x 6 values: past the bound, refused before any work
    huge = {"prompt": [_ids(rng, length) for _ in range(4)], "echo": True, "logprobs": MAX_LOGPROBS, "n": MAX_N,
            "max_tokens": 2}
    with HealthProbe(tiny_server) as probe:
        t0 = time.monotonic()
        r = _post(tiny_server, huge)
        refused_in = time.monotonic() - t0
    assert r.status_code == 400, r.text[:300]
    assert r.json()["error"]["param"] == "logprobs" and str(ENTRY_CAP) in r.json()["error"]["message"]
    assert refused_in < 2 and set(probe.statuses) == {200}
    _still_serves(tiny_server)

    # the largest shape allowed: 2 prompts x n 3, each choice carrying the echoed prompt's logprobs
    n, k = 3, MAX_LOGPROBS
    assert 2 * n * (length + 2) * (k + 1) <= ENTRY_CAP
    prompts = [_ids(rng, length) for _ in range(2)]
    with HealthProbe(tiny_server) as probe:
        r = _post(tiny_server, {"prompt": prompts, "echo": True, "logprobs": k, "n": n, "max_tokens": 2,
                                "ignore_eos": True})
    assert r.status_code == 200, r.text[:300]
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert len(choices) == 2 * n
    for c in choices:
        lp = c["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == length + 2
        assert lp["token_logprobs"][0] is None and all(v <= 0 for v in lp["token_logprobs"][1:])
    for p in range(2):  # the prompt's logprobs are the same in each of its choices
        heads = [{k: v[:length] for k, v in c["logprobs"].items()} for c in choices[p * n:(p + 1) * n]]
        assert all(h == heads[0] for h in heads)
    assert set(probe.statuses) == {200} and probe.slowest < 2.0, probe.slowest

    _still_serves(tiny_server)
    _wait_idle(tiny_server)
    rss1 = tiny_server.rss_mib()
    assert all(b - a < RSS_BOUND_MIB for a, b in zip(rss0, rss1)), (rss0, rss1)


def test_a_prompt_list_cannot_pass_the_sequence_cap(tiny_server):
    rss0 = tiny_server.rss_mib()
    t0 = time.monotonic()
    r = _post(tiny_server, {"prompt": ["hello"] * 1000, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text[:300]
    assert time.monotonic() - t0 < 2
    r = _post(tiny_server, {"prompt": [[5, 6, 7]] * (SEQ_CAP // MAX_N + 1), "n": MAX_N, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text[:300]
    _still_serves(tiny_server)

    # at the cap, the request runs, and a small request beside it is not held behind it
    big_done: list[float] = []

    def big() -> None:
        r = _post(tiny_server, {"prompt": [f"def task_{i}(x):" for i in range(SEQ_CAP)], "max_tokens": 48,
                                "ignore_eos": True})
        assert r.status_code == 200 and len(r.json()["choices"]) == SEQ_CAP
        big_done.append(time.monotonic())

    worker = threading.Thread(target=big)
    worker.start()
    time.sleep(0.3)
    r = _post(tiny_server, {"prompt": "x", "max_tokens": 2})
    small_done = time.monotonic()
    worker.join()
    assert r.status_code == 200 and big_done and small_done < big_done[0]
    _wait_idle(tiny_server)
    rss1 = tiny_server.rss_mib()
    assert all(b - a < RSS_BOUND_MIB for a, b in zip(rss0, rss1)), (rss0, rss1)
