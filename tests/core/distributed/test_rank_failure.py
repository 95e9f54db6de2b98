"""A tensor-parallel rank that dies is reported: the engine fails with an error naming the rank,
within seconds, never a hang; and it stops its other ranks. Every rank starts with NVLink multicast
off, unless its user set otherwise. One 2-rank engine per module."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.core.distributed.multicast import MULTICAST_OFF, multicast_off
from engine.core.errors import EngineDeadError

from tp_helpers import TIMEOUT_S, within


@pytest.fixture(scope="module")
def tp2(tiny_qwen3):
    llm = within(TIMEOUT_S, lambda: LLM(tiny_qwen3, dtype="float32", page_size=4, num_pages=64, progress=False,
                                        tensor_parallel_size=2, distributed_timeout=TIMEOUT_S))
    yield llm
    llm.engine.shutdown()


def test_every_rank_starts_with_multicast_off(tp2):
    (worker,) = tp2.engine.workers.procs
    raw = Path(f"/proc/{worker.pid}/environ").read_bytes().split(b"\0")
    environ = dict(entry.decode().partition("=")[::2] for entry in raw if entry)
    for name, value in MULTICAST_OFF.items():
        assert environ[name] == os.environ[name] == value  # rank 1's, and rank 0's (this process)
    user = {"NCCL_NVLS_ENABLE": "1", "PATH": "/bin"}
    assert multicast_off(user) == {**MULTICAST_OFF, **user}  # what its user set stands


def test_a_killed_rank_fails_the_engine_naming_it(tp2):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    assert len(within(TIMEOUT_S, lambda: tp2.generate([[5, 6, 7, 8]], params))[0].outputs[0].token_ids) == 4
    (worker,) = tp2.engine.workers.procs
    os.kill(worker.pid, signal.SIGKILL)
    # the dead rank is found between steps or by the step it fails: within seconds, not the collective timeout
    with pytest.raises(EngineDeadError, match=r"tensor-parallel rank 1 died \(exit code -9\)"):
        within(10, lambda: tp2.generate([list(range(10, 60))], params))
    with pytest.raises(EngineDeadError, match="rank 1"):
        tp2.engine.check_alive()
    tp2.engine.shutdown()
    assert worker.poll() is not None
