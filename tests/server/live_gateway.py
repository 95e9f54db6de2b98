"""A real ``engine gateway`` (SGLang's smg) in a subprocess on free loopback ports, in front of live workers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from live_server import API_KEY, free_port


class LiveGateway:
    def __init__(self, *args: str, log: Path, api_key: str = API_KEY) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.headers = {"Authorization": f"Bearer {api_key}"}
        cmd = [sys.executable, "-m", "engine.server.cli", "--log-level", "WARNING", "gateway", "--port", str(self.port),
               "--prometheus-port", str(free_port()), "--api-key", api_key, *args]
        self.log_path = log
        self.log = open(log, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "NO_COLOR": "1", "ENGINE_API_KEY": ""})

    def workers(self) -> list[dict]:
        """The gateway's view of its workers: url, worker_type, runtime_type, is_healthy, status, labels."""
        return httpx.get(self.url + "/workers", headers=self.headers, timeout=5).json()["workers"]

    def wait_ready(self, n_workers: int, timeout: float = 120.0) -> "LiveGateway":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine gateway exited with {self.proc.returncode}:\n"
                                   f"{self.log_path.read_text()[-3000:]}")
            try:
                ws = self.workers()
                if len(ws) == n_workers and all(w["is_healthy"] and w["status"] == "ready" for w in ws):
                    return self
            except (httpx.TransportError, KeyError, ValueError):
                pass
            time.sleep(0.3)
        raise TimeoutError(f"the gateway did not register {n_workers} healthy workers:\n"
                           f"{self.log_path.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
