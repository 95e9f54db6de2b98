"""What the multi-process tests share: a deadline, so a hang fails the test instead of blocking it;
and for the tests that run ranks as threads, a few steps of host data and the ranks' runner."""

from __future__ import annotations

import contextvars
import threading
from typing import Any, Callable

import numpy as np
import torch

from engine.core.config import EngineConfig
from engine.core.distributed.group import Rendezvous, join_store, master_store
from engine.core.families.graphs import GraphBackend
from engine.core.runner import ModelRunner, StepInputs
from engine.core.startup import build

TIMEOUT_S = 60.0  # the engines' collective timeout in these tests, and how long a call may take
PAGE_SIZE = 4
# tiny-dsv4-py engines: chunked prefill past the sliding window, greedy tokens
DSV4_OPTS = dict(dtype="float32", page_size=PAGE_SIZE, chunked_prefill_size=32, max_num_batched_tokens=64,
                 max_num_seqs=8, num_pages=256, progress=False)


class ReplayInCaptureContext(GraphBackend):
    """A replay re-runs the captured function through the static buffers, in the context of its
    capture (the MoE exchanges padded), as a device graph replays the work it recorded: a graph's
    semantics without a device, whatever the backends read on the host."""

    name = "rerun"

    def capture(self, fn):
        ctx = contextvars.copy_context()
        ctx.run(fn)
        return lambda: ctx.run(fn)


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


def steps(vocab: int, lengths: tuple[int, int] = (30, 13)) -> list[StepInputs]:
    """Two prompts of ``lengths`` (17..46 and 8..46 tokens) prefilled in two chunks, then two decode
    steps, on pages 1.. of each sequence."""
    la, lb = lengths
    a, b = torch.randint(0, vocab, (la,)).tolist(), torch.randint(0, vocab, (lb,)).tolist()
    tables = np.arange(1, 25, dtype=np.int32).reshape(2, 12)
    out = [StepInputs(a[:16] + b[:7], [16, 7], [0, 0], tables, list(range(23)), [], []),
           StepInputs(a[16:] + b[7:], [la - 16, lb - 7], [16, 7], tables, [la - 17, la + lb - 24], [], [])]
    for i in range(2):
        out.append(StepInputs(torch.randint(0, vocab, (2,)).tolist(), [1, 1], [la + i, lb + i], tables, [0, 1], [], []))
    return out


def run_ranks(config: EngineConfig, size: int, body: Callable[[int, ModelRunner], Any]) -> list[Any]:
    """Each rank's ``body(rank, runner)``, the ranks run as threads of this process on one gloo group."""
    store = master_store(size, TIMEOUT_S)
    results: list[Any] = [None] * size
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            st = store if r == 0 else join_store(store.port, size, TIMEOUT_S)
            c = build(config, progress=False, rendezvous=Rendezvous(r, size, st, TIMEOUT_S))
            runner = ModelRunner(c.model, c.kv, None, None, PAGE_SIZE, c.device, c.graphs, c.attention_group,
                                 prefill_graphs=c.prefill_graphs, verify_graphs=c.verify_graphs, agree=c.plan_group)
            results[r] = body(r, runner)
            c.group.close()
            c.attention_group.close()
            c.plan_group.close()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    if errors:
        raise errors[0]
    return results


def single(config: EngineConfig, inputs: list[StepInputs]) -> list[torch.Tensor]:
    """One process's logits of every step."""
    c = build(config, progress=False)
    runner = ModelRunner(c.model, c.kv, None, None, PAGE_SIZE, c.device)
    return [runner.run(step) for step in inputs]
