"""The architecture a kernel runs on, as the key of every kernel's tuning table.

Tables map an arch (``"sm_90"``, ``"sm_100"``, ``"gfx942"``, ``"gfx950"``), a vendor
(``"cuda"``, ``"hip"``) or ``"default"`` to launch parameters; the most specific key wins. The
interpreter (``TRITON_INTERPRET=1``, tensors on the CPU) reads ``"default"``.
"""

from __future__ import annotations

from typing import Any, Mapping, TypeVar

import torch

T = TypeVar("T")


def arch_of(device: torch.device) -> str:
    """``sm_XY`` on NVIDIA, ``gfxNNN`` on AMD, ``cpu`` for the interpreter."""
    if device.type != "cuda":
        return "cpu"
    props = torch.cuda.get_device_properties(device)
    if getattr(torch.version, "hip", None):
        return props.gcnArchName.split(":")[0]
    return f"sm_{props.major}{props.minor}"


def vendor_of(arch: str) -> str:
    return "hip" if arch.startswith("gfx") else "cuda" if arch.startswith("sm_") else "cpu"


def pick(table: Mapping[str, T], arch: str) -> T:
    """The entry for ``arch``, else for its vendor, else ``table["default"]``."""
    for key in (arch, vendor_of(arch), "default"):
        if key in table:
            return table[key]
    raise KeyError(f"tuning table has no entry for {arch!r} and no default")


def config_for(table: Mapping[str, Any], device: torch.device) -> Any:
    return pick(table, arch_of(device))
