"""Engine death (of the engine process, or of one of its tensor-parallel ranks), a stopped engine, SIGTERM/SIGINT drain (to the process or its whole group), abort on
shutdown timeout, 429 past the concurrency cap, and no engine or sockets left after a killed server."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import time

from pathlib import Path

import httpx
import pytest

from engine.server.liveness import SILENCE_S
from live_server import LiveServer, engine_children


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


def _start(tiny_qwen3, tmp_path, *args, own_session: bool = False) -> LiveServer:
    return LiveServer(str(tiny_qwen3), "--max-model-len", "1024", *args, api_key=None,
                      log=tmp_path / "server.log", own_session=own_session).wait_ready()


def _ipc_dir(engine: int) -> Path:
    argv = Path(f"/proc/{engine}/cmdline").read_bytes().split(b"\0")
    return Path(argv[argv.index(b"--ipc-dir") + 1].decode())


def _wait_health(server, status: int, within: float) -> float:
    t0 = time.monotonic()
    while (r := httpx.get(server.url + "/health", timeout=10)).status_code != status:
        assert time.monotonic() - t0 < within, f"/health still {r.status_code} after {within} s"
        time.sleep(0.05)
    return time.monotonic() - t0


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


def test_a_killed_rank_turns_health_503_and_every_rank_exits(tiny_qwen3, tmp_path):
    """4 tensor-parallel ranks over gloo, streams in flight: rank 2 killed. The others, rank 0 (the
    engine process) included, are stopped and reaped by the time the server has exited."""
    server = _start(tiny_qwen3, tmp_path, "--tensor-parallel-size", "4", "--num-pages", "256")
    engine = server.engine_pid()
    ranks = {int(Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[4]): pid for pid in engine_children(engine)}
    assert sorted(ranks) == [1, 2, 3]

    async def main():
        async with httpx.AsyncClient(timeout=60) as client:
            jobs = await _started_streams(client, server, 2, 900)
            os.kill(ranks[2], signal.SIGKILL)
            t0 = time.monotonic()
            while (health := await client.get(server.url + "/health")).status_code != 503:
                assert time.monotonic() - t0 < 5, "/health still 200 five seconds after a rank died"
                await asyncio.sleep(0.05)
            return health.json()["error"]["message"], await asyncio.gather(*jobs)

    why, reasons = asyncio.run(main())
    assert "tensor-parallel rank 2 died (exit code -9)" in why
    assert reasons == ["error", "error"]
    assert server.proc.wait(20) == 1
    assert [pid for pid in (engine, *ranks.values()) if not _gone(pid)] == []  # none left, not even a zombie


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


def test_stopped_engine_turns_health_503_and_a_killed_server_leaves_nothing(tiny_qwen3, tmp_path):
    server = _start(tiny_qwen3, tmp_path)
    engine = server.engine_pid()
    ipc = _ipc_dir(engine)
    assert ipc.is_dir()
    os.kill(engine, signal.SIGSTOP)
    try:
        took = _wait_health(server, 503, SILENCE_S + 3)
        assert "said nothing" in httpx.get(server.url + "/health").json()["error"]["message"]
    finally:
        os.kill(engine, signal.SIGCONT)
    assert took >= SILENCE_S - 1  # not before the silence threshold: no false alarm from one slow beat
    _wait_health(server, 200, 5)
    r = httpx.post(server.url + "/v1/completions", json=_body(3, stream=False), timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3

    server.proc.kill()  # SIGKILL: the API process cannot clean up; the engine must
    server.proc.wait(10)
    t0 = time.monotonic()
    while not (_gone(engine) and not ipc.exists()):
        assert time.monotonic() - t0 < 10, f"engine alive: {not _gone(engine)}, sockets left: {ipc.exists()}"
        time.sleep(0.1)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["TERM", "INT"])
def test_a_signal_to_the_process_group_drains(tiny_qwen3, tmp_path, sig):
    """What a process manager (kill -TERM -PGID) or Ctrl-C in a terminal sends: the engine process,
    in its own session, is not hit; the API process drains it as for a signal to itself."""
    server = _start(tiny_qwen3, tmp_path, "--shutdown-timeout", "60", own_session=True)
    engine = server.engine_pid()
    assert os.getpgid(engine) != server.proc.pid

    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            jobs = await _started_streams(client, server, 4, 48)
            os.killpg(server.proc.pid, sig)
            return await asyncio.gather(*jobs)

    assert asyncio.run(main()) == ["length"] * 4
    assert server.proc.wait(30) == 0
    assert _gone(engine)


def test_a_body_that_completes_during_the_drain_is_refused(tiny_qwen3, tmp_path):
    """A request counts once its body is in; one still uploading when the drain begins is not
    admitted after it (503), rather than slipping in past the drain."""
    server = _start(tiny_qwen3, tmp_path, "--shutdown-timeout", "30")
    body = json.dumps({"prompt": "def f(x):", "max_tokens": 2}).encode()
    host, port = server.url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=10)
    try:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(body)}\r\n\r\n".encode() + body[:5])
        time.sleep(0.3)
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        s.sendall(body[5:])
        assert s.recv(4096).startswith(b"HTTP/1.1 503")
    finally:
        s.close()
    assert server.proc.wait(30) == 0
