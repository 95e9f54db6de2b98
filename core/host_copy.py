"""Device tensors on their way to the host, behind the work queued so far.

A step's results (its draws, their logprobs, prompt logprobs) are read when the engine processes
the step, while the device runs the next one. The copies go into pinned memory behind an event on
CUDA, so queueing them waits for nothing; the first read waits for the event, the reads after it
for nothing.
"""

from __future__ import annotations

import torch


class HostCopy:
    def __init__(self, tensors: list[torch.Tensor]) -> None:
        pinned = bool(tensors) and tensors[0].is_cuda
        self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned).copy_(t, non_blocking=pinned)
                      for t in tensors]
        self._copied = None
        if pinned:
            self._copied = torch.cuda.Event()
            self._copied.record()

    def __len__(self) -> int:
        return len(self._host)

    def wait(self) -> None:
        """Wait for the copies, once."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None

    def tolist(self, i: int) -> list:
        """The ``i``-th tensor as (nested) lists."""
        self.wait()
        return self._host[i].tolist()
