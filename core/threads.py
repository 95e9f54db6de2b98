"""Torch's CPU thread count, chosen from the cores this process may run on (its affinity, which a
container or ``taskset`` narrows), not the machine's: threads that spin on cores another process
holds stall every step they take part in."""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)


def usable_cores() -> int:
    """Cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def set_cpu_threads(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
    logger.info("%d torch CPU threads (%d usable cores)", threads, usable_cores())
