"""Torch's CPU threads: the server's engine process takes the cores it may use less one
(``--cpu-threads`` setting them is checked through ``engine generate`` in tests/server/test_cli.py)."""

from __future__ import annotations

import random

from engine.core import threads
from engine.server.serve import engine_process_threads


def test_the_engine_process_leaves_one_core_to_the_api_process(monkeypatch):
    cores = random.randrange(2, 64)
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    assert engine_process_threads() == cores - 1
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert engine_process_threads() == 1

