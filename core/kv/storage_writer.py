"""Writing records to the storage tier (L3) on a thread of its own, so the engine loop never waits on
a file system or a remote store.

The engine hands over records whose bytes are already on the host (copies of their pages, taken
when host memory took them: a page freed or overwritten later changes nothing queued here). The
queue holds at most ``MAX_QUEUED_BYTES``; a write that finds it full is dropped, counted, and
logged once per burst of drops, rather than stalling the loop: the prefix stays in host memory,
and storage misses it until it is written again. A write the tier refuses (a full disk, a gone
mount) stops the writer: what is queued after it is dropped, and the engine, which polls
``failure``, detaches the tier. ``close`` lets the queue drain (bounded) and drops what is left.
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


class StorageWriter:
    def __init__(self, tier: CacheTier, written: Callable[[list[TierPage], list[bool]], None]) -> None:
        """``written(records, stored)`` is called on the writer's thread after each write."""
        self.tier, self._written = tier, written
        self.dropped = 0  # records not written: the queue was full, the tier had failed, or it closed
        self.failure: str | None = None  # why the tier refused a write; nothing is written after it
        self._queue: deque[list[TierPage]] = deque()
        self._queued_bytes = 0
        self._busy = False
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
                self._busy = True
            try:
                stored = self.tier.put(records)
            except Exception as exc:  # a tier's bug must not end the writer silently: the tier is dropped
                stored = [False] * len(records)
                self.tier.last_error = f"{type(exc).__name__}: {exc}"
            self._written(records, stored)
            with self._cond:
                self._queued_bytes -= sum(r.data.numel() for r in records)
                self._busy = False
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
            while self._queue or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, drain_s: float | None = None) -> None:
        """Write what is queued for up to ``drain_s`` seconds (``CLOSE_DRAIN_S``), drop the rest (counted)
        and stop; a write under way ends alone (whole or not at all: the tier's writes are atomic)."""
        atexit.unregister(self.close)
        drain_s = CLOSE_DRAIN_S if drain_s is None else drain_s
        if drain_s > 0:
            self.flush(drain_s)
        with self._cond:
            self._closing = True
            self._drop_queued()
            self._cond.notify_all()
        if drain_s > 0:  # shutting down: the thread ends before the process does (not at detach: no wait there)
            self._thread.join(drain_s)
