"""Writing records to the storage tier (L3) on a thread of its own, so the engine loop never waits on
a file system or a remote store.

The engine hands over records whose bytes are already on the host (copies of their pages, taken
when host memory took them: a page freed or overwritten later changes nothing queued here). The
queue holds at most ``MAX_QUEUED_BYTES``; a write that finds it full is dropped, counted, and
logged once per burst of drops, rather than stalling the loop: the prefix stays in host memory,
and storage misses it until it is written again. A write the tier refuses (a full disk, a gone
mount) stops the writer: what is queued after it is dropped, and the engine, which polls
``failure``, detaches the tier. ``close`` (the engine closing, or the tier detached or replaced)
lets the queue drain for a bounded time, drops what is left and logs both counts: a detach from a
healthy tier loses nothing, and one from a hanging tier still returns.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections import deque
from typing import Callable

from ..families.cache_tier import CacheTier, TierPage

logger = logging.getLogger(__name__)

MAX_QUEUED_BYTES = 256 * 2**20  # record bytes waiting for the storage tier
CLOSE_DRAIN_S = 10.0  # how long a closing engine (or one whose process exits) lets queued writes land
DETACH_DRAIN_S = 5.0  # how long a detach lets them land (the engine loop waits for it between two steps)


class StorageWriter:
    def __init__(self, tier: CacheTier, written: Callable[[list[TierPage], list[bool]], None]) -> None:
        """``written(records, stored)`` is called on the writer's thread after each write."""
        self.tier, self._written = tier, written
        self.written = 0  # records the tier took
        self.dropped = 0  # records not written: the queue was full, the tier had failed, or it closed
        self.failure: str | None = None  # why the tier refused a write; nothing is written after it
        self._queue: deque[list[TierPage]] = deque()
        self._queued_bytes = 0
        self._under_way = 0  # records in the write the tier is making now
        self._closing = False
        self._dropping = False  # in a burst of drops (logged at its start)
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="hicache-storage-writer", daemon=True)
        self._thread.start()
        atexit.register(self.close)  # a process ending without closing its engine still writes what it queued

    def submit(self, records: list[TierPage]) -> bool:
        """Queue ``records`` for the tier; False (dropped, counted) where the queue is full, the tier
        has failed or the writer is closing. Never blocks on the tier."""
        size = sum(r.data.numel() for r in records)
        with self._cond:
            full = bool(self._queue) and self._queued_bytes + size > MAX_QUEUED_BYTES
            if full or self.failure is not None or self._closing:
                self.dropped += len(records)
                if full and not self._dropping:
                    logger.warning("hierarchical cache: the storage tier %s is behind (%d MiB queued); writes "
                                   "are dropped until it catches up (%d records so far)", self.tier.name,
                                   self._queued_bytes >> 20, self.dropped)
                self._dropping = self._dropping or full
                return False
            self._dropping = False
            self._queue.append(records)
            self._queued_bytes += size
            self._cond.notify_all()
            return True

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue:
                    return
                records = self._queue.popleft()
                self._under_way = len(records)
            try:
                stored = self.tier.put(records)
            except Exception as exc:  # a tier's bug must not end the writer silently: the tier is dropped
                stored = [False] * len(records)
                self.tier.last_error = f"{type(exc).__name__}: {exc}"
            self._written(records, stored)
            with self._cond:
                self._queued_bytes -= sum(r.data.numel() for r in records)
                self._under_way = 0
                self.written += sum(stored)
                if not all(stored) and self.failure is None:
                    self.failure = self.tier.last_error or "no reason given"
                    self._drop_queued()
                self._cond.notify_all()

    def _drop_queued(self) -> None:
        self.dropped += sum(len(r) for r in self._queue)
        self._queue.clear()
        self._queued_bytes = 0

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write has landed (or been refused); whether it did in time."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._queue or self._under_way:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, drain_s: float | None = None) -> None:
        """Write what is queued for up to ``drain_s`` seconds (``CLOSE_DRAIN_S``) in all, drop the rest
        (counted) and stop; a write still under way then ends alone (whole or not at all: the tier's
        writes are atomic) and is counted when it does."""
        atexit.unregister(self.close)
        drain_s = CLOSE_DRAIN_S if drain_s is None else drain_s
        deadline = time.monotonic() + drain_s
        with self._cond:
            waiting = sum(len(r) for r in self._queue) + self._under_way
            written, dropped = self.written, self.dropped
        self.flush(drain_s)
        with self._cond:
            self._closing = True
            self._drop_queued()
            self._cond.notify_all()
            written, given_up, under_way = self.written - written, self.dropped - dropped, self._under_way
        if waiting:
            logger.log(logging.WARNING if given_up or under_way else logging.INFO,
                       "hierarchical cache: the storage tier %s closed with %d records to write: %d written, "
                       "%d given up after %.1f s%s", self.tier.name, waiting, written, given_up, drain_s,
                       f", {under_way} in a write still under way" if under_way else "")
        self._thread.join(max(0.0, deadline - time.monotonic()))
