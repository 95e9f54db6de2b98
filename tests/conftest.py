"""Shared fixtures: the ../shared folder, fresh-but-reproducible randomness, GPU skipping."""

from __future__ import annotations

import os
import random
import sys
import time
from pathlib import Path

import pytest
import torch

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
RUN_SEED = int(os.environ.get("ENGINE_TEST_SEED", time.time_ns() % 2**31))


def pytest_report_header(config):
    return f"engine test seed: {RUN_SEED} (set ENGINE_TEST_SEED to repeat a run)"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA or ROCm device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """After a failed test, the interpreted kernels' kept-zero counters back at zero: a kernel that
    raised part way (its programs run one after another on CPU) leaves its ticket and arrivals set,
    and the next test's launch would spin on them forever instead of failing by itself."""
    report = (yield).get_result()
    if report.failed:
        _zero_cpu_counters()


def _zero_cpu_counters() -> None:
    decode = sys.modules.get("engine.backends.triton.attention_decode")
    boundary = sys.modules.get("engine.backends.triton.mhc_boundary")
    held = [t for ts in (decode._KEPT_ZERO.values() if decode else ()) for t in ts]
    held += list(boundary._COUNTERS.__dict__.get("by_device", {}).values()) if boundary else []
    with torch.inference_mode():  # buffers first made inside the engine's inference mode are inference tensors
        for t in held:
            if t.device.type == "cpu":
                t.zero_()


@pytest.fixture(scope="session")
def run_seed() -> int:
    """This run's seed, for module-scoped fixtures that build something random once per run."""
    return RUN_SEED


@pytest.fixture
def seed(request) -> int:
    """A fresh seed each run (reported in the header), distinct per test, seeding torch and random."""
    s = (RUN_SEED + sum(map(ord, request.node.nodeid))) % 2**31
    torch.manual_seed(s)
    random.seed(s)
    return s


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    if not SHARED.is_dir():
        pytest.skip(f"{SHARED} is not present")
    return SHARED


@pytest.fixture(scope="session")
def tiny_qwen3(shared_dir) -> Path:
    return shared_dir / "models" / "tiny-qwen3-py"


@pytest.fixture(scope="session")
def eval_text(shared_dir) -> str:
    return (shared_dir / "data" / "python-eval.txt").read_text()
