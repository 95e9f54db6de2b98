"""A decode engine's KV transfer totals: what moved, and what its prefix cache spared moving.

A msgspec Struct with no torch, so the engine process sends it to the API process as it is
(server/wire.py) and /metrics renders it (server/metrics.py).
"""

from __future__ import annotations

import msgspec


class TransferCounters(msgspec.Struct):
    """Since start-up: transfers done and failed (a failed one's prompt is computed here), the pages and bytes received, and the pages not
    sent because the prefix cache held them already."""

    num_transfers: int = 0
    num_failed: int = 0
    pages_received: int = 0
    bytes_received: int = 0
    pages_reused: int = 0

    def snapshot(self) -> TransferCounters:
        return msgspec.structs.replace(self)
