"""The hierarchical cache's totals and tier usage, as /metrics shows them.

A msgspec Struct with no torch, so the engine process sends it to the API process as it is
(server/wire.py) and server/metrics.py renders it. Tiers are named as the metrics name them:
``l1`` the device, ``l2`` host memory, ``l3`` the storage tier. A write goes into a tier (pages
leaving the device for host memory, records host memory takes reaching storage), a read comes out
of it (host records loaded to the device, storage records fetched into host memory).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from .hierarchy import KVHierarchy
    from .manager import KVStats

TIERS = ("l1", "l2", "l3")


@dataclass
class TierStats:
    """What crossed between the device and the lower tier (records: one per page, or per window)."""

    written_pages: int = 0
    written_windows: int = 0
    refused: int = 0  # records the lower tier had no room for
    loaded_pages: int = 0
    loaded_windows: int = 0
    written_rows: int = 0  # a proposer's rows of a page (page_rows.py)
    loaded_rows: int = 0  # rows records given back to the proposer
    missed_rows: int = 0  # rows a match's pages lacked in the proposer and the lower tier had not, intact
    hit_tokens: int = 0  # prefix tokens a match found only in the lower tier and loaded back
    checksum_failures: int = 0
    bytes_written: int = 0
    bytes_loaded: int = 0
    storage_written: int = 0  # records written to the storage tier
    storage_refused: int = 0  # records it did not take (full, unreachable)
    storage_dropped: int = 0  # records never handed to it (of writers since detached: storage_dropped())
    storage_hit_tokens: int = 0  # prefix tokens found only in storage and brought into host memory
    storage_loaded_tokens: int = 0  # of hit_tokens, those a match brought from storage in the same load
    storage_bytes_written: int = 0
    storage_bytes_read: int = 0
    foreign_records: int = 0  # storage files that were not a record of their key (of tiers since detached)
    storage_read_failures: int = 0  # reads that failed other than by absence (of tiers since detached)


class HiCacheStats(msgspec.Struct):
    """Since start-up (or the warm-up's reset): prefix tokens hit per tier, bytes per tier and
    direction, records that failed their checksum or were not a record of their key, storage
    operations that failed (a full disk, an unreachable store), a proposer's rows records written, read
    and missed; now: bytes used and capacity per tier."""

    hit_tokens: dict[str, int] = msgspec.field(default_factory=dict)
    bytes_written: dict[str, int] = msgspec.field(default_factory=dict)
    bytes_read: dict[str, int] = msgspec.field(default_factory=dict)
    checksum_failures: int = 0
    storage_failures: int = 0
    storage_dropped: int = 0  # records never written to storage (its writer's queue full, or the tier gone)
    used_bytes: dict[str, int] = msgspec.field(default_factory=dict)
    capacity_bytes: dict[str, int] = msgspec.field(default_factory=dict)
    storage_backend: str | None = None  # the L3 tier attached now, if any
    rows: dict[str, int] = msgspec.field(default_factory=dict)  # a proposer's rows records (page_rows.py), where
    # it has some: "written" below the device, "read" (given back to it), "missed" (a match's, absent or bad)


def snapshot(lower: KVHierarchy, kv: KVStats) -> HiCacheStats:
    """The hierarchy's totals; L1's hit tokens are the prefix cache's hits less those loaded from below
    (a load is counted when it happens, a hit when its request is admitted: never below zero)."""
    s, layout = lower.stats, lower.tier.ctx.layout
    l3 = s.storage_loaded_tokens
    l2 = s.hit_tokens - l3
    page, window = layout.record_bytes("page"), (layout.record_bytes("window") if "window" in layout.segments else 0)
    used = {"l1": kv.num_used * page + kv.num_window_used * window}
    capacity = {"l1": kv.num_usable * page + kv.num_window_usable * window}
    storage = lower.reader.tier if lower.reader is not None else None
    rows = {"written": s.written_rows, "read": s.loaded_rows, "missed": s.missed_rows} if lower.rows is not None else {}
    for name, tier in (("l2", lower.tier), ("l3", storage)):
        usage = tier.usage() if tier is not None else None
        if usage is not None:
            used[name], capacity[name] = usage
    return HiCacheStats(
        hit_tokens={"l1": max(0, kv.prefix_hits - l2 - l3), "l2": l2, "l3": l3},
        bytes_written={"l2": s.bytes_written, "l3": s.storage_bytes_written},
        bytes_read={"l2": s.bytes_loaded, "l3": s.storage_bytes_read},
        checksum_failures=s.checksum_failures + s.foreign_records + (storage.rejected if storage is not None else 0),
        storage_failures=s.storage_refused + s.storage_read_failures + (storage.read_failures if storage is not None else 0),
        storage_dropped=lower.storage_dropped(), used_bytes=used, capacity_bytes=capacity,
        storage_backend=storage.name if storage is not None else None, rows=rows)
