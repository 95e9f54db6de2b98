"""NVLink multicast left off: NCCL's NVLink SHARP (NVLS) algorithms, PyTorch's symmetric-memory
multicast and NVSHMEM's NVLS all map multicast objects across the GPUs of a host, and a program that
does so can leave GPUs that other programs share out of service. Every rank of the engine starts
with these settings, unless its user set them: rank 0 sets them in its own environment before its
process group is made (NCCL and PyTorch read them when they build their communicators), and starts
the other ranks' processes with them."""

from __future__ import annotations

import os
from collections.abc import MutableMapping

MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def multicast_off(env: MutableMapping[str, str] = os.environ) -> MutableMapping[str, str]:
    """``env`` with multicast off wherever its user did not set the variable."""
    for name, value in MULTICAST_OFF.items():
        env.setdefault(name, value)
    return env
