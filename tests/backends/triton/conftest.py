"""Triton kernel tests: in the interpreter where no GPU is present, compiled on a GPU.

``TRITON_INTERPRET`` must be set before any kernel is decorated, so it is set here, at
collection time, and only when there is no GPU (a GPU run compiles the same kernels for real).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="interpreter tests run where TRITON_INTERPRET=1 (no GPU)")
    for item in items:
        if "interpret" in item.keywords and not INTERPRETING:
            item.add_marker(skip)


@pytest.fixture
def poisoned_empty(monkeypatch):
    """Every tensor torch.empty gives starts as poison (NaN, or -7 in integers): a slot the kernel
    forgets to write shows."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        out = empty(*args, **kwargs)
        return out.fill_(float("nan") if out.is_floating_point() else -7)

    monkeypatch.setattr(torch, "empty", poisoned)
