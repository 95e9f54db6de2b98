"""A real ``engine serve`` in a subprocess on a free loopback port, for tests that talk HTTP to it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

API_KEY = "test-key-0123456789"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_children(pid: int) -> list[int]:
    """Pids of the engine processes a server started (read from /proc)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d.name))
    return out


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise ValueError(f"no VmRSS for {pid}")


class LiveServer:
    def __init__(self, model: str | None, *extra: str, api_key: str | None = API_KEY,
                 env: dict[str, str] | None = None, log: Path | None = None, own_session: bool = False) -> None:
        """``own_session``: the server leads its own process group, so a test can signal the group."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        cmd = [sys.executable, "-m", "engine.server.cli", "--log-level", "WARNING", "serve", "--port", str(self.port),
               *(["--model", model] if model else []), *(["--api-key", api_key] if api_key else []), *extra]
        self.log_path = log
        self.log = open(log, "w") if log else subprocess.DEVNULL
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "ENGINE_API_KEY": "", **(env or {})},
                                     start_new_session=own_session)
        self.model_name = Path(model).name if model else None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def wait_ready(self, timeout: float = 240.0) -> "LiveServer":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log_path.read_text()[-3000:] if self.log_path else ""
                raise RuntimeError(f"engine serve exited with {self.proc.returncode} before it was ready:\n{tail}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    models = httpx.get(self.url + "/v1/models", headers=self.headers, timeout=5).json()
                    self.model_name = models["data"][0]["id"]
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError("engine serve did not become healthy")

    def engine_pid(self) -> int:
        (pid,) = engine_children(self.proc.pid)
        return pid

    def rss_mib(self) -> tuple[float, float]:
        """Resident memory of the API process and of its engine process, in MiB (from /proc)."""
        return rss_mib(self.proc.pid), rss_mib(self.engine_pid())

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics by its full name with labels; model_name labels dropped."""
        text = httpx.get(self.url + "/metrics", headers=self.headers, timeout=10).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name.replace(f'model_name="{self.model_name}",', "").replace(f'{{model_name="{self.model_name}"}}', "")] = float(value)
        return out

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.log is not subprocess.DEVNULL:
            self.log.close()
        return self.proc.returncode
