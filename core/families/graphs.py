"""Graphs family: capture a forward step once, then replay it as one launch.

A backend captures a zero-argument function that reads only tensors which stay where they are
(static buffers) and returns its output tensor; replaying re-runs the captured device work on
whatever the buffers hold then. The engine's decode path (core/graph_runner.py) owns the buffers;
the backend owns the capture mechanics (CUDA graphs, HIP graphs) and their memory pool.

A ``breakable`` backend also records a forward in segments (core/prefill_graphs.py): the device
work between two breaks, where calls whose work depends on the step's shape run eagerly
(core/breaks.py). Every segment of every capture shares the backend's one memory pool, so a
segment's temporaries take memory only while the recorded forward held them.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from contextvars import ContextVar
from typing import Any, Callable, Iterator

import torch

# where a recording on the host keeps the work that torch's dispatcher does not show it (None: none records)
HOST_WORK: ContextVar[list | None] = ContextVar("host_work", default=None)


def host_work(work: Callable[[], None]) -> None:
    """Run ``work``, device work issued outside torch's operators (a collective's call into its
    process group): a device graph captures what it launches by itself, and a recording on the host
    (core/native/graphs.py) keeps it in order with the operators around it, to run again in each replay."""
    work()
    recording = HOST_WORK.get()
    if recording is not None:
        recording.append((work, (), {}, None))


_BUCKET_SHAPED: ContextVar[bool] = ContextVar("bucket_shaped", default=False)


@contextlib.contextmanager
def bucket_shaped() -> Iterator[None]:
    """Within it, the work is shaped by the graph's bucket, not by the step's tokens (a padded MoE
    exchange's blocks): a recorded break here (core/breaks.py) takes and returns its tensors whole
    in every replay, where elsewhere it cuts them to the step's tokens."""
    token = _BUCKET_SHAPED.set(True)
    try:
        yield
    finally:
        _BUCKET_SHAPED.reset(token)


def in_bucket_shape() -> bool:
    return _BUCKET_SHAPED.get()


class GraphBackend(ABC):
    name: str = "?"
    breakable: bool = False  # records segments: begin_segment, end_segment, carry, unowned

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx

    @abstractmethod
    def capture(self, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        """Warm ``fn`` up, capture it, and return a replay that yields the same output tensor."""

    def warm_up(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` eagerly as a capture will, so that what it builds lazily (compiled kernels,
        workspaces) exists before; nothing where nothing is built lazily."""

    def memory_in_use(self) -> int:
        """Bytes the device holds now (for the capture budget); 0 where unknown."""
        return 0

    def begin_segment(self) -> None:
        """Start recording the device work issued from here on, as one segment."""
        raise NotImplementedError(f"the {self.name} graphs backend records no segments")

    def end_segment(self) -> Callable[[], None]:
        """Stop recording; returns the segment's replay. The recorded work has run once when this
        returns, so its outputs hold values for the eager work after it."""
        raise NotImplementedError(f"the {self.name} graphs backend records no segments")

    def carry(self, value: torch.Tensor) -> torch.Tensor:
        """Called while a segment records: a tensor shaped as ``value`` in graph memory, for the
        segment to read; it holds ``value`` when the recorded work first runs, and in a replay
        whatever was written into it (through ``unowned``) before."""
        raise NotImplementedError(f"the {self.name} graphs backend records no segments")

    def unowned(self, t: torch.Tensor) -> torch.Tensor:
        """A tensor over ``t``'s memory that does not keep it allocated, so that graph memory the
        recorded forward freed is reused by what it allocated later; valid while a replay runs in
        the order of the recording."""
        raise NotImplementedError(f"the {self.name} graphs backend records no segments")
