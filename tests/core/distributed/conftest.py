"""The tests here make this process rank 0 (or every rank) of a group, which sets the host's thread
count for its share of the cores: put it back for the tests that follow."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
