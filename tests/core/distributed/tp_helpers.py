"""What the multi-process tests share: a deadline, so a hang fails the test instead of blocking it."""

from __future__ import annotations

import threading
from typing import Any, Callable

TIMEOUT_S = 60.0  # the engines' collective timeout in these tests, and how long a call may take


def within(seconds: float, fn: Callable[[], Any]) -> Any:
    """fn()'s result or exception, or an AssertionError once ``seconds`` pass (fn left running)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the caller
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        raise AssertionError(f"still running after {seconds} s: a hang")
    if "error" in box:
        raise box["error"]
    return box["value"]
