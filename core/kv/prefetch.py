"""Reading a prefix's pages from a storage tier (L3) while its request waits, by a stop policy.

A prefetch starts when a request arrives and the storage holds at least ``threshold`` tokens of
its prompt past what the device and host memory already know; a thread reads the records in
order, in as few runs as fit ``READ_BATCH_BYTES`` each: one ``get`` of the tier a run, which the
tier serves as one request where it can (one NIXL transfer of many descriptors, S3 GETs at once),
so a long hit does not pay a round trip a page. When the request is
admitted, the policy says how long it waits for the rest (SGLang's names): ``best_effort`` not
at all, ``wait_complete`` until every record is read, ``timeout`` at most ``TIMEOUT_BASE +
TIMEOUT_PER_KI_TOKEN`` per 1,024 tokens; the reads stop and the records read so far (whole runs)
are what the hit gets.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ..families.cache_tier import CacheTier, TierPage

TIMEOUT_BASE = 1.0  # seconds
TIMEOUT_PER_KI_TOKEN = 0.25  # seconds per 1,024 tokens
READ_BATCH_BYTES = 64 << 20  # a run's records in one get: one request's worth, the host memory a read holds


@dataclass
class Prefetch:
    """One prefix's records on their way from storage, in order."""

    keys: list[str]
    start_page: int  # the prefix page the first key is for
    records: list[TierPage] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)
    stop: bool = False


class StorageReader:
    def __init__(self, tier: CacheTier, policy: str, threshold_tokens: int, page_size: int, record_bytes: int) -> None:
        """``record_bytes``: a page record's size (the layout's), which bounds how many a read asks for."""
        self.tier, self.policy, self.page_size = tier, policy, page_size
        self.threshold_pages = max(1, -(-threshold_tokens // page_size))
        self.batch_pages = max(1, READ_BATCH_BYTES // max(1, record_bytes))
        self._threads = ThreadPoolExecutor(1, thread_name_prefix="hicache-storage")

    def start(self, keys: list[str], start_page: int) -> Prefetch | None:
        """Start reading the leading ``keys`` the tier holds, if they are enough to be worth it."""
        held = self.tier.contains(keys)
        if held < self.threshold_pages:
            return None
        p = Prefetch(keys[:held], start_page)
        self._threads.submit(self._read, p)
        return p

    def _read(self, p: Prefetch) -> None:
        try:
            for i in range(0, len(p.keys), self.batch_pages):
                if p.stop:
                    break
                got = self.tier.get(p.keys[i:i + self.batch_pages])
                for rec in got:
                    if rec is None:
                        return
                    p.records.append(rec)
        finally:
            p.done.set()

    def take(self, p: Prefetch) -> list[TierPage]:
        """The records read by the time the policy stops waiting; the reads stop."""
        if self.policy == "wait_complete":
            p.done.wait()
        elif self.policy == "timeout":
            tokens = len(p.keys) * self.page_size
            p.done.wait(TIMEOUT_BASE + TIMEOUT_PER_KI_TOKEN * tokens / 1024)
        p.stop = True
        return list(p.records)

    def close(self) -> None:
        """Read no more (the tier is detached): reads not started are dropped, one under way ends alone."""
        self._threads.shutdown(wait=False, cancel_futures=True)

    def read_now(self, keys: list[str]) -> list[TierPage]:
        """The leading records of ``keys`` the tier holds, read at once (small reads: windows)."""
        out = []
        for rec in self.tier.get(keys):
            if rec is None:
                break
            out.append(rec)
        return out
