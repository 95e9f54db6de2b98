"""The S3 tier's test bed: moto's S3 server on loopback, counting what it answers: requests by method and the most it
answered at once (what shows a tier's reads and writes batched: one round trip for a run, not one a
record), each held ``delay_s`` first where asked (a store at a network's distance: on loopback the
server's own CPU is the whole cost), a PUT whose path ``refuse`` picks answered 403 (a store
refusing a write: a full quota, a denied key). Used by tests/plugins/test_nixl_obj_tier.py and
benchmarks/hicache_l3_reads.py; needs ``pip install moto[server]``. And ``import_nixl``: the nixl build
whose OBJ plugin loads here."""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
import threading
import time
from collections import Counter
from typing import Callable

import torch

from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
from werkzeug.serving import make_server

REFUSED = b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>AccessDenied</Code><Message>refused</Message></Error>'


def import_nixl() -> None:
    """nixl's meta package takes nixl_cu13 where torch has no CUDA (a CPU machine), and nixl-cu13
    1.5.1's OBJ plugin needs libcuobjclient.so.1, which no wheel carries; nixl-cu12's has all it
    needs, so the import goes as under a CUDA 12 torch where nixl-cu12 is installed."""
    if "nixl" not in sys.modules and torch.version.cuda is None and importlib.util.find_spec("nixl_cu12"):
        torch.version.cuda = "12"
        try:
            importlib.import_module("nixl")
        finally:
            torch.version.cuda = None


class LoopbackS3:
    def __init__(self, delay_s: float = 0.0) -> None:
        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # a line a request otherwise
        self.delay_s = delay_s
        self.refuse: Callable[[str], bool] = lambda path: False  # which PUTs (by path) to refuse
        self.requests: Counter[str] = Counter()
        self.most_at_once = 0
        self._at_once, self._lock = 0, threading.Lock()
        self._app = DomainDispatcherApplication(create_backend_app)
        self._server = make_server("127.0.0.1", 0, self._answer, threaded=True, request_handler=MotoRequestHandler)
        host, port = self._server.server_address[:2]
        self.url = f"http://{host}:{port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def _answer(self, environ, start_response):
        with self._lock:
            self.requests[environ["REQUEST_METHOD"]] += 1
            self._at_once += 1
            self.most_at_once = max(self.most_at_once, self._at_once)
        try:
            time.sleep(self.delay_s)
            if environ["REQUEST_METHOD"] == "PUT" and self.refuse(environ["PATH_INFO"]):
                environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))  # the connection stays usable
                start_response("403 Forbidden", [("Content-Type", "application/xml")])
                return [REFUSED]
            return self._app(environ, start_response)
        finally:
            with self._lock:
                self._at_once -= 1

    def reset(self) -> None:
        """Count from nothing again."""
        with self._lock:
            self.requests.clear()
            self.most_at_once = 0

    def stop(self) -> None:
        self._server.shutdown()
        self._thread.join()
