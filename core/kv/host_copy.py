"""Records on their way from the device to host memory, ordered after the work that wrote them.

On CUDA the gather of the pages and the copy into pinned host memory are queued on the current
stream, behind the step that wrote the pages and ahead of any later kernel that reuses them (a
load's copy stream waits on this stream before it writes, layer_loads.py), and an event says when
the bytes have landed: the host goes on without waiting for the step. On the CPU the copy is
taken at once, in program order.
"""

from __future__ import annotations

import torch


class HostCopy:
    def __init__(self, data: torch.Tensor, event: torch.cuda.Event | None = None) -> None:
        self._data, self._event = data, event

    def __len__(self) -> int:
        return len(self._data)

    def __getitem__(self, rows: slice) -> HostCopy:
        """The copy of some of its rows, landing with the rest."""
        return HostCopy(self._data[rows], self._event)

    def ready(self) -> bool:
        """Whether the bytes are on the host (never waits)."""
        return self._event is None or self._event.query()

    def wait(self) -> torch.Tensor:
        """The host tensor, once its bytes have landed."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self._data


def to_host(rows: torch.Tensor) -> HostCopy:
    """A copy of ``rows`` (a tensor no later work changes: a gather's result) on the host."""
    if rows.device.type != "cuda":
        return HostCopy(rows.cpu())
    host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
    host.copy_(rows, non_blocking=True)
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(rows.device))
    return HostCopy(host, event)
