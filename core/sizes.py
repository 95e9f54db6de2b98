"""Memory sizes as people write them ('4GiB', '512MB', 1073741824): one parser for the Python API
and the command line."""

from __future__ import annotations

import re

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_size(value: str | int | float) -> int:
    """'2GiB', '512MB', '1073741824' or a number -> bytes; a ValueError that shows the forms otherwise."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return int(value)
    m = _SIZE.match(value) if isinstance(value, str) else None
    unit = (m[2] or "").lower() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(f"not a memory size: {value!r} (e.g. 2GiB, 512MiB, 1073741824)")
    return int(float(m[1]) * _UNITS[unit])
