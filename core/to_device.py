"""Small host lists on the device without waiting for it.

``torch.tensor(values, device="cuda")`` copies from pageable memory and then synchronises the
stream, so the host waits for every step already queued: one such call in the step loop undoes
overlapped decode. Here the values go through pinned memory and are copied behind the queued
work; torch's pinned-memory allocator keeps the host block until the copy has run.
"""

from __future__ import annotations

import torch


def to_device(values, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``values`` (a list, or a tuple, of numbers) as a ``dtype`` tensor on ``device``."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
