"""Graphs family: capture a forward step once, then replay it as one launch.

A backend captures a zero-argument function that reads only tensors which stay where they are
(static buffers) and returns its output tensor; replaying re-runs the captured device work on
whatever the buffers hold then. The engine's decode path (core/graph_runner.py) owns the buffers;
the backend owns the capture mechanics (CUDA graphs, HIP graphs) and their memory pool.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable

import torch


class GraphBackend(ABC):
    name: str = "?"

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx

    @abstractmethod
    def capture(self, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        """Warm ``fn`` up, capture it, and return a replay that yields the same output tensor."""

    def memory_in_use(self) -> int:
        """Bytes the device holds now (for the capture budget); 0 where unknown."""
        return 0
