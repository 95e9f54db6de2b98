"""Engine death, SIGTERM drain, abort on shutdown timeout, and 429 past the concurrency cap."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx

from live_server import LiveServer


def _body(max_tokens: int, stream: bool = True) -> dict:
    return {"prompt": "def main():", "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}


async def _finish_reason(client: httpx.AsyncClient, url: str, body: dict, started: asyncio.Event | None = None):
    """The stream's final finish_reason, 'error' for an in-stream error, or the HTTP status if not 200."""
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return r.status_code
            reason = None
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return "error"
                if started is not None:
                    started.set()
                if chunk["choices"] and chunk["choices"][0]["finish_reason"]:
                    reason = chunk["choices"][0]["finish_reason"]
            return reason
    except httpx.TransportError:
        return "disconnected"


async def _started_streams(client: httpx.AsyncClient, server, n: int, max_tokens: int) -> list[asyncio.Task]:
    """``n`` streamed completions, returned once each has sent its first chunk."""
    started = [asyncio.Event() for _ in range(n)]
    jobs = [asyncio.create_task(_finish_reason(client, server.url, _body(max_tokens), e)) for e in started]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
    return jobs


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _start(tiny_qwen3, tmp_path, *args) -> LiveServer:
    return LiveServer(str(tiny_qwen3), "--max-model-len", "1024", *args, api_key=None,
                      log=tmp_path / "server.log").wait_ready()


def test_killed_engine_turns_health_503_fails_requests_and_exits(tiny_qwen3, tmp_path):
    server = _start(tiny_qwen3, tmp_path)
    engine = server.engine_pid()

    async def main():
        async with httpx.AsyncClient(timeout=60) as client:
            started = asyncio.Event()
            inflight = asyncio.create_task(_finish_reason(client, server.url, _body(900), started))
            await asyncio.wait_for(started.wait(), 60)
            os.kill(engine, signal.SIGKILL)
            t0 = time.monotonic()
            while (await client.get(server.url + "/health")).status_code != 503:
                assert time.monotonic() - t0 < 5, "/health still 200 five seconds after the engine died"
                await asyncio.sleep(0.05)
            refused = await client.post(server.url + "/v1/completions", json=_body(4, stream=False))
            return await inflight, refused

    reason, refused = asyncio.run(main())
    assert reason == "error"  # the waiting stream hears it, it is not left hanging
    assert refused.status_code == 503 and refused.json()["error"]["message"]
    assert server.proc.wait(20) == 1
    assert _gone(engine)


def test_sigterm_drains_in_flight_and_refuses_new_work(tiny_qwen3, tmp_path):
    server = _start(tiny_qwen3, tmp_path, "--shutdown-timeout", "60", "--max-concurrent-requests", "8")
    engine = server.engine_pid()

    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            jobs = await _started_streams(client, server, 8, 48)
            over = await client.post(server.url + "/v1/completions", json=_body(4, stream=False))
            server.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.5)
            try:
                late = (await client.post(server.url + "/v1/completions", json=_body(4, stream=False))).status_code
            except httpx.TransportError:
                late = "refused"
            return over, late, await asyncio.gather(*jobs)

    over, late, reasons = asyncio.run(main())
    assert over.status_code == 429 and over.json()["error"]["type"] == "rate_limit_error"
    assert late in (503, "refused")
    assert reasons == ["length"] * 8  # every in-flight request ran to its end
    assert server.proc.wait(30) == 0
    assert _gone(engine)  # stopped and reaped, not orphaned


def test_sigterm_with_zero_timeout_aborts_and_exits_fast(tiny_qwen3, tmp_path):
    server = _start(tiny_qwen3, tmp_path, "--shutdown-timeout", "0")
    engine = server.engine_pid()

    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            jobs = await _started_streams(client, server, 4, 900)
            t0 = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            reasons = await asyncio.gather(*jobs)
            return reasons, t0

    reasons, t0 = asyncio.run(main())
    assert reasons == ["abort"] * 4
    assert server.proc.wait(10) == 0
    assert time.monotonic() - t0 < 6
    assert _gone(engine)


def test_restart_mode_brings_a_new_engine_up(tiny_qwen3, tmp_path):
    server = _start(tiny_qwen3, tmp_path, "--on-engine-death", "restart")
    first = server.engine_pid()
    os.kill(first, signal.SIGKILL)
    t0 = time.monotonic()
    while httpx.get(server.url + "/health").status_code != 503:
        assert time.monotonic() - t0 < 5
        time.sleep(0.05)
    while httpx.get(server.url + "/health").status_code != 200:
        assert time.monotonic() - t0 < 120, "no new engine within two minutes"
        time.sleep(0.2)
    r = httpx.post(server.url + "/v1/completions", json=_body(3, stream=False), timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    second = server.engine_pid()
    assert second != first and _gone(first)
    assert server.stop() == 0 and _gone(second)
