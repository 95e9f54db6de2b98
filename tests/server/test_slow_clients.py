"""Slow and idle connections cannot take the server: bodies count only once in, slow headers and
bodies are cut off, one address cannot hold every connection. A server of its own, with short
timeouts and small caps, so the cases run in seconds."""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from live_server import LiveServer

CAP, PER_CLIENT, HEADER_S, BODY_S = 4, 16, 1.0, 1.5


@pytest.fixture(scope="module")
def guarded(tiny_qwen3, tmp_path_factory):
    server = LiveServer(str(tiny_qwen3), "--max-model-len", "256", "--max-concurrent-requests", str(CAP),
                        "--max-connections-per-client", str(PER_CLIENT), "--header-timeout", str(HEADER_S),
                        "--body-timeout", str(BODY_S), api_key=None,
                        log=tmp_path_factory.mktemp("logs") / "guarded.log").wait_ready()
    yield server
    server.stop()


def _connect(server) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=10)
    return s


def _stalled_body(server) -> socket.socket:
    """Headers and a few bytes of a 100-byte body, then nothing."""
    s = _connect(server)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: 100\r\n\r\n{\"prompt\":")
    return s


def _closed_within(s: socket.socket, seconds: float) -> tuple[bool, bytes]:
    """Whether the server closed the socket within ``seconds``, and what it said before."""
    s.settimeout(0.2)
    deadline, said = time.monotonic() + seconds, b""
    while time.monotonic() < deadline:
        try:
            chunk = s.recv(4096)
        except socket.timeout:
            continue
        except ConnectionResetError:
            return True, said
        if not chunk:
            return True, said
        said += chunk
    return False, said


def _ok(server) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", json={"prompt": "def f(x):", "max_tokens": 2}, timeout=30)


def _in_flight(server) -> float:
    return server.metrics()["engine:num_requests_in_flight"]


def test_stalled_bodies_neither_fill_the_cap_nor_stay(guarded):
    stalled = [_stalled_body(guarded) for _ in range(CAP * 3)]
    try:
        time.sleep(0.2)
        r = _ok(guarded)  # the stalled uploads are not in flight: real work still gets in
        assert r.status_code == 200, r.text
        assert _in_flight(guarded) == 0
        for s in stalled:
            closed, said = _closed_within(s, BODY_S + 3)
            assert closed and said.startswith(b"HTTP/1.1 408"), said[:200]
    finally:
        for s in stalled:
            s.close()
    assert _ok(guarded).status_code == 200
    assert httpx.get(guarded.url + "/health").status_code == 200 and _in_flight(guarded) == 0


@pytest.mark.parametrize("after_a_request", [False, True], ids=["fresh", "keep-alive"])
def test_slowloris_headers_are_cut_off(guarded, after_a_request):
    s = _connect(guarded)
    try:
        if after_a_request:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert s.recv(4096).startswith(b"HTTP/1.1 200")
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        t0, closed = time.monotonic(), False
        while time.monotonic() - t0 < HEADER_S + 4:
            try:
                s.sendall(b"X-a: b\r\n")  # one header line every 0.2 s, never the blank line
            except OSError:
                closed = True
                break
            closed, _ = _closed_within(s, 0.2)
            if closed:
                break
        assert closed, "a connection trickling headers was kept open"
        assert time.monotonic() - t0 < HEADER_S + 2
    finally:
        s.close()
    assert _ok(guarded).status_code == 200


def test_one_address_cannot_hold_every_connection(guarded):
    held = [_connect(guarded) for _ in range(PER_CLIENT)]
    try:
        extra = _connect(guarded)
        closed, said = _closed_within(extra, 2)
        extra.close()
        assert closed and said.startswith(b"HTTP/1.1 429"), said[:200]
    finally:
        for s in held:
            s.close()
    time.sleep(0.2)
    assert _ok(guarded).status_code == 200
    assert httpx.get(guarded.url + "/health").status_code == 200 and _in_flight(guarded) == 0
