"""The tests here make this process rank 0 (or every rank) of a group, which sets the host's thread
count for its share of the cores: put it back for the tests that follow. tiny-dsv4-py and one
process's engine of it, for the modules that compare parallel engines with it."""

from __future__ import annotations

import pytest
import torch

from engine import LLM

from tp_helpers import DSV4_OPTS


@pytest.fixture(autouse=True, scope="module")
def _restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def dsv4(shared_dir):
    return shared_dir / "models" / "tiny-dsv4-py"


@pytest.fixture(scope="module")
def single(dsv4) -> LLM:
    return LLM(dsv4, **DSV4_OPTS)
