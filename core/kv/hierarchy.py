"""The hierarchical KV cache: the prefix cache's pages kept below the device, and brought back.

The radix tree (radix.py) records which tiers hold each node; this moves the bytes and applies
the write policy, as SGLang's HiCache names them:

- ``write_through``: a node's pages go to the lower tier as soon as the tree stores them;
- ``write_through_selective``: once a match has gone through the node ``SELECTIVE_HITS`` times;
- ``write_back``: when the node leaves the device.

A node leaving the device whose pages the lower tier holds stays in the tree there (demoted);
one it does not hold is dropped. A prefix match that runs past the device into nodes only the
lower tier holds loads them back into fresh device pages before the step that needs them (the
scheduler's match, so before that step's forward), whole nodes at a time. DeepSeek-V4's windowed
components (window.py) travel too: the node where a stored prefix ends keeps, beside its pages,
the records of the windows of the pages within reach of that end, so a loaded hit restores every
component or ends at an earlier node that has them (honestly shorter).

Every record carries the checksum taken when it was written and is checked when it is read: a
record that fails is a miss (counted), the nodes from it on leave the tree, and their tokens are
computed again. A load's pages reach the device layer by layer beside the next forward
(layer_loads.py: on CUDA a copy stream and an event per layer). A write waits for nothing: the
tree records the node below at once, its room in host memory taken, while its pages are copied to
the host behind the step that wrote them (host_copy.py); the records are checksummed and put in
host memory once landed, then handed to the storage tier's writer thread (storage_writer.py).

A proposer's rows kept per page (DSpark's context rows, page_rows.py) go with the pages: written
beside a node's pages where the proposer has them, discarded with them, read from storage with
them, and given back to the proposer when a match ends on pages whose rows it let go. A rows
record missing, foreign or failing its checksum is a miss for the rows only (counted, dropped):
the page hit stands, and the proposer drafts from what it has.

Write-back and selective write-through write a node's pages later than the tree stores them, by
when the proposer may have let their rows go (it keeps them least recently used first, in its own
budget). So under those policies the tree's storing a node takes a host copy of the rows the
proposer has of its pages (``_stage_rows``), held on the node until its pages are written (the
copy becomes their rows records) or the node leaves the tree (the copy goes with it); a match on
the device meanwhile gives the proposer back from it what it let go. That is at most one rows
record per device page, in host memory: bounded by the device cache, taken once per page as
write-through takes it, and with no bookkeeping of its own (the tree's nodes are it). Handing rows
down when the proposer lets them go would need the proposer to name the pages its digests stand
for; keeping them on the device until written would spend device memory the proposer's budget
does not count.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from ..config import HICACHE_WRITE_POLICIES
from ..families.cache_tier import CacheTier, TierPage, prefix_keys
from .hicache_stats import TierStats
from .host_copy import HostCopy, to_host
from .page_rows import KIND as ROWS
from .page_rows import PageRows, rows_key
from .pages import PagePool
from .prefetch import Prefetch, StorageReader
from .radix import RadixCache, Tier
from .storage import KVCache
from .storage_writer import DETACH_DRAIN_S, StorageWriter
from .tier_layout import window_keys
from .window import WindowPool

if TYPE_CHECKING:
    from .radix import _Node

logger = logging.getLogger(__name__)

CHECK_THREADS = min(8, os.cpu_count() or 1)  # threads checking a load's checksums
SELECTIVE_HITS = 2  # matches through a node before write_through_selective writes it
MAX_PREFETCHES = 256  # storage reads of requests not admitted yet


@dataclass
class _Landing:
    """Records on their way from the device to the lower tier."""

    keys: list[str]
    kind: str
    copy: HostCopy


class KVHierarchy:
    def __init__(self, radix: RadixCache, pool: PagePool, kv: KVCache, window: WindowPool | None, tier: CacheTier,
                 policy: str = "write_through", model_key: str = "", rows: PageRows | None = None) -> None:
        if policy not in HICACHE_WRITE_POLICIES:
            raise ValueError(f"hicache_write_policy must be one of {HICACHE_WRITE_POLICIES}, got {policy!r}")
        self.radix, self.pool, self.kv, self.window, self.tier = radix, pool, kv, window, tier
        self.policy = policy
        self.model_key = model_key
        self.rows = rows  # a proposer's rows of each page, which go with the pages
        self.page_size = radix.page_size
        self.stats = TierStats()
        self._pinned = kv.device.type == "cuda"
        self._checker = ThreadPoolExecutor(CHECK_THREADS, thread_name_prefix="hicache-checksum") \
            if CHECK_THREADS > 1 else None
        self.reader: StorageReader | None = None
        self.writer: StorageWriter | None = None  # writes to the storage tier, beside the reader
        self._prefetches: dict[str, Prefetch] = {}  # by the key of the first page each reads
        self._landing: deque[_Landing] = deque()  # records copied from the device, in the order queued
        self._pending: dict[str, str] = {}  # the kind of each record on its way, its room taken
        self._reserved: Counter[str] = Counter()  # records on their way, by kind
        radix.lower = self

    def reset_stats(self) -> None:
        """Zero the totals (the storage tier's own counts too)."""
        self.stats = TierStats()
        if self.reader is not None:
            self.reader.tier.rejected = self.reader.tier.read_failures = 0
            self.writer.dropped = 0

    # -- what the radix tree asks -------------------------------------------------------------

    def inserted(self, node: _Node) -> None:
        """The tree stored a prefix ending at ``node``: write-through writes what is not below yet;
        the other policies, which write later, keep a copy of the proposer's rows of it now."""
        for n in self.radix.path(node):
            if self.policy == "write_through":
                self._save(n)
            else:
                self._stage_rows(n)

    def matched(self, node: _Node) -> None:
        """A match went through ``node`` (and its ancestors): selective write-through counts it."""
        if self.policy != "write_through_selective":
            return
        for n in self.radix.path(node):
            n.hits += 1
            if n.hits >= SELECTIVE_HITS:
                self._save(n)

    def keep(self, node: _Node) -> bool:
        """``node`` is leaving the device: whether the lower tier holds its pages (write-back writes
        them now), so it is demoted rather than dropped."""
        if self.policy == "write_back" or Tier.HOST in node.tiers:
            self._save(node)
        return Tier.HOST in node.tiers

    def forget(self, node: _Node) -> None:
        """The tree no longer refers to ``node``'s records (those still on their way are dropped)."""
        keys = (node.lower or []) + (node.lower_window or []) + self._rows_keys(node.lower or [])
        self.tier.discard([k for k in keys if not self._unreserve(k)])

    # -- writing ------------------------------------------------------------------------------

    def _save(self, node: _Node) -> None:
        """Put the node's pages, and the windows its end holds, in the lower tier where they are not
        yet: their room is taken and the tree records them now; the bytes follow, copied behind the
        step that wrote them (host_copy.py), and land in the tier when there (``settle``)."""
        self.settle()
        if Tier.HOST not in node.tiers:
            keys = self._keys(node)
            if self._reserve(node, keys, "page"):
                node.lower = keys
                node.tiers.add(Tier.HOST)
                self.stats.written_pages += len(keys)
                self._landing.append(_Landing(keys, "page", self.kv.copy_records(node.pages)))
                self._save_rows(node, keys)
        if node.window is not None and node.lower_window is None and node.lower:
            keys = window_keys(node.lower[-1], len(node.window))
            if self._reserve(node, keys, "window"):
                node.lower_window = keys
                self.stats.written_windows += len(keys)
                rows = [self.window.page_of(p) for p in node.window]
                self._landing.append(_Landing(keys, "window", self.kv.copy_records(rows, windowed=True)))
        self.settle()  # what is there already (on the CPU: everything)

    def _save_rows(self, node: _Node, keys: list[str]) -> None:
        """Put the rows of the node's pages (``keys``), from the first, in the lower tier beside them:
        those copied when the tree stored it (``_stage_rows``), else those the proposer keeps now."""
        if self.rows is None:
            return
        rows, node.rows = node.rows, None
        if rows is None:
            records = self._held_rows(node)
            rows = to_host(records) if records is not None else None
        if not rows:
            return
        keys = self._rows_keys(keys[:len(rows)])
        if self._reserve(node, keys, ROWS):
            self.stats.written_rows += len(keys)
            self._landing.append(_Landing(keys, ROWS, rows))

    def _stage_rows(self, node: _Node) -> None:
        """Copy to the host, on the node, the proposer's rows of its pages (from the first) where they
        are not written yet and it has some: the pages may be written after it lets them go."""
        if self.rows is None or node.rows is not None or Tier.HOST in node.tiers:
            return
        records = self._held_rows(node)
        if records is not None:
            node.rows = to_host(records)

    def _held_rows(self, node: _Node) -> torch.Tensor | None:
        """The proposer's rows of the node's pages it keeps, from the first (on the device)."""
        tokens, count = self.radix.prefix(node), len(node.key) // self.page_size
        return self.rows.records(tokens, len(tokens) // self.page_size - count, count)

    def _rows_keys(self, page_keys: list[str]) -> list[str]:
        return [rows_key(k, self.rows.identity) for k in page_keys] if self.rows is not None else []

    def settle(self, wait: bool = False) -> None:
        """Put the records whose bytes have landed (``wait``: all of them, waiting for the device) in
        the lower tier, checksummed now, and hand them to the storage tier; those whose node let
        them go meanwhile (``forget``) are dropped. The engine calls it after every step (and waits
        once it has nothing left to run), so records land without a later request to carry them."""
        while self._landing and (wait or self._landing[0].copy.ready()):
            landing = self._landing.popleft()
            rows = landing.copy.wait()
            self.stats.bytes_written += rows.numel()
            records = [TierPage.of(k, r, landing.kind) for k, r in zip(landing.keys, rows) if self._unreserve(k)]
            if not records:
                continue
            done = self.tier.put(records)
            if not all(done):  # room was taken for them: only a tier refusing them outright gets here
                self.stats.refused += len(done) - sum(done)
                records = [r for r, ok in zip(records, done) if ok]
            self._store(records)

    def _reserve(self, keep: _Node, keys: list[str], kind: str) -> bool:
        """Take room in the lower tier for ``keys``' records of ``kind`` (all or none)."""
        if not self._make_room(keep, kind, len(keys)):
            self.stats.refused += len(keys)
            return False
        self._pending.update((k, kind) for k in keys)
        self._reserved[kind] += len(keys)
        return True

    def _unreserve(self, key: str) -> bool:
        """Give back the room taken for ``key``; whether it was still taken."""
        kind = self._pending.pop(key, None)
        if kind is not None:
            self._reserved[kind] -= 1
        return kind is not None

    def _make_room(self, keep: _Node, kind: str, n: int) -> bool:
        """Whether ``n`` more records of ``kind`` fit in the lower tier beside those on their way,
        after letting go of others (never ``keep``'s or those below it)."""
        if self.tier.free(kind) is None:
            return True
        room = lambda: self.tier.free(kind) - self._reserved[kind] >= n  # noqa: E731
        return room() or self.radix.release_lower(room, keep=keep)

    def _put(self, keep: _Node, records: list[TierPage]) -> bool:
        """Store ``records`` (of one kind, read from storage) in host memory, making room first (never
        at the expense of ``keep`` or what is below it); all or none."""
        kind, n = records[0].kind, len(records)
        done = self.tier.put(records) if self._make_room(keep, kind, n) else [False] * n
        if not all(done):
            self.tier.discard([r.key for r, ok in zip(records, done) if ok])
            self.stats.refused += n
            return False
        return True

    def _store(self, records: list[TierPage]) -> None:
        """Hand what host memory took to the storage tier's writer too, where there is one (never
        waiting on the tier: a full queue drops the write, storage_writer.py)."""
        if self.reader is None or self._storage_failed():
            return
        self.writer.submit(records)

    def _written(self, records: list[TierPage], stored: list[bool]) -> None:
        """The writer's thread wrote ``records`` (``stored`` says which the tier took)."""
        self.stats.storage_written += sum(stored)
        self.stats.storage_refused += len(stored) - sum(stored)
        self.stats.storage_bytes_written += sum(r.data.numel() for r, ok in zip(records, stored) if ok)

    def _storage_failed(self) -> bool:
        """Whether the storage tier refused a write (a full disk, an unreachable store): then it is
        detached, logged once; serving goes on with host memory, and an operator may attach it
        again (the admin route)."""
        if self.reader is None or self.writer.failure is None:
            return False
        tier, failure = self.reader.tier, self.writer.failure
        self.detach_storage()
        logger.warning("hierarchical cache: the storage tier %s failed a write (%s); detached, serving goes on "
                       "with host memory only", tier.name, failure)
        return True

    def flush_storage(self, timeout: float | None = None) -> bool:
        """Wait until the writes handed to the storage tier have landed (detaching it where one
        failed); whether they did in time."""
        self.settle(wait=True)
        done = self.writer is None or self.writer.flush(timeout)
        self._storage_failed()
        return done

    def storage_dropped(self) -> int:
        """Records never written to storage: its writer's queue was full, or the tier had failed or gone."""
        return self.stats.storage_dropped + (self.writer.dropped if self.writer is not None else 0)

    def close(self) -> None:
        """The engine stops: queued storage writes land (for a bounded time), the rest are dropped."""
        self.settle(wait=True)
        if self.writer is not None:
            self.writer.close()

    # -- the storage tier (L3) --------------------------------------------------------------------

    def attach_storage(self, tier: CacheTier, policy: str, threshold_tokens: int) -> None:
        """Keep what host memory takes in ``tier`` too, and fetch prefixes from it (prefetch.py)."""
        if self.reader is not None:
            self.detach_storage()
        self.reader = StorageReader(tier, policy, threshold_tokens, self.page_size,
                                    sum(self.kv.record_segments()))
        self.writer = StorageWriter(tier, self._written)

    @contextlib.contextmanager
    def storage_paused(self):
        """Neither write to nor read from the storage tier while the block runs (the start-up
        warm-up's made-up prompts); it is attached again after."""
        reader, self.reader = self.reader, None
        try:
            yield
        finally:
            self.reader = reader

    def detach_storage(self) -> CacheTier | None:
        """Stop using the storage tier (its prefetches dropped, its counts kept in the totals) once the
        writes queued for it have landed (for up to ``DETACH_DRAIN_S``; the rest dropped, counted); the
        tier, or None where there was none. Host memory and the device keep what they hold."""
        if self.reader is None:
            return None
        reader, self.reader = self.reader, None
        writer, self.writer = self.writer, None
        writer.close(DETACH_DRAIN_S)  # queued writes land first (bounded); one still under way ends alone
        self.stats.storage_dropped += writer.dropped
        self.stats.foreign_records += reader.tier.rejected
        self.stats.storage_read_failures += reader.tier.read_failures
        for p in self._prefetches.values():
            p.stop = True
        self._prefetches.clear()
        reader.close()
        return reader.tier

    def prefetch(self, tokens: list[int]) -> None:
        """A request arrived: start reading from storage what it may hit past the tree."""
        self.settle()
        if self.reader is None or self._storage_failed():
            return
        _, start, keys = self._beyond(tokens)
        if keys and keys[0] not in self._prefetches:
            p = self.reader.start(keys, start)
            if p is not None:
                self._prefetches[keys[0]] = p
                while len(self._prefetches) > MAX_PREFETCHES:  # requests that never came to be admitted
                    self._prefetches.pop(next(iter(self._prefetches))).stop = True

    def _beyond(self, tokens: list[int]) -> tuple[_Node, int, list[str]]:
        """The deepest node of ``tokens``' prefix the tree knows (on any tier), its whole pages, and
        the keys of the pages past it."""
        frontier, pages, lower = self.radix.lower_path(tokens)
        known = len(pages) + sum(len(n.lower) for n in lower)
        return (lower[-1] if lower else frontier), known, prefix_keys(tokens, self.page_size, self.model_key)[known:]

    def _fetch(self, tokens: list[int]) -> int:
        """Bring what storage holds of ``tokens`` past the tree into host memory, as a node there;
        the tokens it holds."""
        anchor, start, keys = self._beyond(tokens)
        if not keys:
            return 0
        p = self._prefetches.pop(keys[0], None) or self.reader.start(keys, start)
        if p is None:
            return 0
        taken = self.reader.take(p)
        self.stats.storage_bytes_read += sum(r.data.numel() for r in taken)
        records = self._stored_intact(taken, "page")
        count, windows = len(records), None
        while count and self.window is not None:  # the end must bring its windows
            windows = self._stored_windows(keys[count - 1], start + count)
            if windows is not None:
                break
            count -= 1
        if not count:
            return 0
        self.radix.lock(anchor)
        try:
            if not self._put(anchor, records[:count]) or windows is not None and not self._put(anchor, windows):
                return 0
            self._fetch_rows(anchor, keys[:count])
            self.radix.attach_lower(tokens, keys[:count], [w.key for w in windows] if windows is not None else None)
            self.stats.storage_hit_tokens += count * self.page_size
            return count * self.page_size
        finally:
            self.radix.unlock(anchor)

    def _fetch_rows(self, anchor: _Node, page_keys: list[str]) -> None:
        """Bring the proposer's rows of the pages under ``page_keys`` that storage holds, intact, from
        the first, into host memory beside them (where there is room: else the rows miss)."""
        if self.rows is None:
            return
        got = self.reader.read_now(self._rows_keys(page_keys))
        self.stats.storage_bytes_read += sum(r.data.numel() for r in got)
        good = self._stored_intact(got, ROWS)
        if good:
            self._put(anchor, good)

    def _stored_windows(self, end_key: str, num_pages: int) -> list[TierPage] | None:
        """The intact window records storage holds for a prefix of ``num_pages`` pages ending at ``end_key``."""
        keys = window_keys(end_key, self.radix.tail_pages(num_pages))
        if self.reader.tier.contains(keys[:1]) == 0:
            return None
        got = self.reader.read_now(keys)
        self.stats.storage_bytes_read += sum(r.data.numel() for r in got)
        good = self._stored_intact(got, "window")
        return good if len(good) == len(keys) else None

    def _stored_intact(self, records: list[TierPage], kind: str) -> list[TierPage]:
        """The leading ``records`` read from storage that are of ``kind`` and intact; the first that
        is not is counted, and the storage tier drops it (``reject``) so a good one can be written."""
        good = []
        for rec, ok in zip(records, self.intact(records)):
            if rec.kind != kind or not ok:
                self.stats.checksum_failures += 1
                self.reader.tier.reject(rec.key)
                break
            good.append(rec)
        return good

    def _keys(self, node: _Node) -> list[str]:
        tokens = self.radix.prefix(node)
        return prefix_keys(tokens, self.page_size, self.model_key)[-(len(node.key) // self.page_size):]

    # -- loading ------------------------------------------------------------------------------

    def load(self, tokens: list[int], reserve: Callable[[int], bool]) -> int:
        """Bring back to the device the nodes only the lower tier holds on ``tokens``' cached prefix
        (and the windows of its end, where the device let them go); the tokens loaded. ``reserve(n)``
        frees ``n`` device pages (evicting) or says it cannot."""
        self.settle()
        fetched = self._fetch(tokens) if self.reader is not None and not self._storage_failed() else 0
        frontier, device_pages, lower = self.radix.lower_path(tokens)
        if not lower:
            self._restore_windows(frontier, device_pages)
            self._restore_rows(tokens, frontier, len(device_pages))
            return 0
        bad = None
        self.radix.lock(lower[-1])  # neither its path on the device nor its records go meanwhile
        try:
            records, bad = self._read([k for n in lower for k in n.lower], "page")
            end, count, windows = self._end(lower, len(records), len(device_pages))
            if end is None or windows is not None and not self._window_room(len(windows)) or not reserve(count):
                return 0
            pages = self.pool.alloc(count)
            self.kv.write_records(pages, self._batch(records[:count]))
            start = 0
            for n in lower[:lower.index(end) + 1]:
                self.radix.promote(n, pages[start:start + len(n.lower)])
                start += len(n.lower)
            self.stats.loaded_pages += count
            self.stats.hit_tokens += count * self.page_size
            below = sum(len(n.lower) for n in lower) * self.page_size  # the fetched node is the path's last
            self.stats.storage_loaded_tokens += max(0, count * self.page_size - (below - fetched))
            if windows is not None:
                self._hold_windows(end, device_pages + pages, windows)
            self._restore_rows(tokens, frontier, len(device_pages) + count)
            return count * self.page_size
        finally:
            self.radix.unlock(lower[-1])
            if bad is not None:
                self.radix.drop(next(n for n in lower if bad in n.lower))

    def _restore_rows(self, tokens: list[int], end: _Node, num_pages: int) -> None:
        """Give the proposer back the rows of the first ``num_pages`` pages of ``tokens`` (a match's,
        on the device now, ``end`` the last node it had there) that it let go: those copied on nodes
        not written yet, then those the lower tier holds, intact, from the first it lacks; a bad one is
        counted and let go (a miss for the rows only)."""
        if self.rows is None or (held := self.rows.held(tokens, num_pages)) >= num_pages:
            return
        first = 0
        for n in self.radix.path(end):
            if n.rows is not None and first + len(n.rows) > held:
                skip = max(0, held - first)
                self.rows.restore(tokens, first + skip, list(n.rows.wait()[skip:]))
                self.stats.loaded_rows += len(n.rows) - skip
            first += len(n.key) // self.page_size
        if (held := self.rows.held(tokens, num_pages)) < num_pages:
            keys = self._rows_keys(prefix_keys(tokens, self.page_size, self.model_key)[held:num_pages])
            records, bad = self._read(keys, ROWS)
            if bad is not None and self.tier.contains([bad]):
                self.tier.discard([bad])
            if records:
                self.rows.restore(tokens, held, records)
                self.stats.loaded_rows += len(records)
        self.stats.missed_rows += num_pages - self.rows.held(tokens, num_pages)

    def _end(self, lower: list[_Node], num_records: int, num_device_pages: int):
        """The deepest node of ``lower`` a load can end at (its records, and the windows of its end
        for a model that has windows, all intact), the pages to load, and those windows' records."""
        ends, total = [], 0
        for n in lower:
            total += len(n.lower)
            ends.append(total)
        for i in reversed(range(len(lower))):
            if ends[i] > num_records:
                continue
            if self.window is None:
                return lower[i], ends[i], None
            if lower[i].lower_window is not None:
                windows = self._windows(lower[i], num_device_pages + ends[i])
                if windows is not None:
                    return lower[i], ends[i], windows
        return None, 0, None

    def _windows(self, end: _Node, num_pages: int) -> list[torch.Tensor] | None:
        """The intact window records of ``end``'s tail (a prefix of ``num_pages`` pages), or None:
        records that fail are let go."""
        records, bad = self._read(end.lower_window, "window")
        if bad is None and len(records) == self.radix.tail_pages(num_pages):
            return records
        self.tier.discard(end.lower_window)
        end.lower_window = None
        return None

    def _read(self, keys: list[str], kind: str) -> tuple[list[torch.Tensor], str | None]:
        """The leading records of ``keys`` that are there and intact, and the key of the first that
        is missing or fails its checksum (None if every one is good)."""
        if any(k in self._pending for k in keys):  # a node demoted before its bytes landed: they are needed now
            self.settle(wait=True)
        got = self.tier.get(keys)
        present = list(itertools.takewhile(lambda r: r is not None and r.kind == kind, got))
        good: list[torch.Tensor] = []
        for key, rec, ok in zip(keys, present, self.intact(present)):
            if not ok:
                self.stats.checksum_failures += 1
                return good, key
            good.append(rec.data)
        if len(present) < len(keys):
            self.stats.checksum_failures += got[len(present)] is not None  # a record of another kind
            return good, keys[len(present)]
        return good, None

    def intact(self, records: list[TierPage]) -> list[bool]:
        """Whether each record's bytes match its checksum, checked on several threads where the host
        has the cores (hashing lets go of the GIL): the checksums bound a load's host side."""
        if self._checker is None or len(records) < 2:
            return [r.intact() for r in records]
        return list(self._checker.map(TierPage.intact, records))

    def _batch(self, records: list[torch.Tensor]) -> torch.Tensor:
        """The records as one [n, bytes] host tensor, pinned for the device where it is a GPU."""
        out = torch.empty(len(records), records[0].numel(), dtype=torch.uint8, pin_memory=self._pinned)
        torch.stack(records, out=out)
        self.stats.bytes_loaded += out.numel()
        return out

    def _window_room(self, num_pages: int) -> bool:
        return self.window.num_free >= num_pages or self.radix.release_windows(num_pages)

    def _restore_windows(self, end: _Node, path_pages: list[int]) -> None:
        """Let ``end`` (the deepest node of a match on the device) hold the windows of its tail again
        from its window records, where it holds none."""
        if self.window is None or end.window is not None or end.lower_window is None or not path_pages:
            return
        windows = self._windows(end, len(path_pages))
        if windows is not None and self._window_room(len(windows)):
            self._hold_windows(end, path_pages, windows)

    def _hold_windows(self, end: _Node, path_pages: list[int], records: list[torch.Tensor]) -> None:
        """``end`` holds the windows of its tail; those no one held get their bytes from ``records``."""
        tail = path_pages[len(path_pages) - len(records):]
        fresh = [i for i, p in enumerate(tail) if not self.window.has(p)]
        self.window.hold(tail)
        end.window = tail
        if fresh:
            rows = [self.window.page_of(tail[i]) for i in fresh]
            self.kv.write_records(rows, self._batch([records[i] for i in fresh]), windowed=True)
        self.stats.loaded_windows += len(fresh)

    # -- checks -------------------------------------------------------------------------------

    def check_consistency(self) -> None:
        """Raise AssertionError unless the lower tier holds, or has room taken for, exactly the records
        the tree refers to."""
        referred, rows = set(), set()  # a page's rows may be missing (the proposer had none)
        for n in self.radix.lower_nodes():
            if len(n.lower) * self.page_size != len(n.key):
                raise AssertionError(f"a node of {len(n.key)} tokens has {len(n.lower)} lower-tier records")
            referred.update(n.lower + (n.lower_window or []))
            rows.update(self._rows_keys(n.lower))
        referred |= rows
        pending = set(self._pending)
        if sum(self._reserved.values()) != len(pending) or any(v < 0 for v in self._reserved.values()):
            raise AssertionError(f"room taken for {dict(self._reserved)} records, {len(pending)} on their way")
        held = self.tier.keys() if hasattr(self.tier, "keys") else referred - pending
        if held & pending:
            raise AssertionError(f"{len(held & pending)} record(s) both held and on their way")
        if held | pending | rows != referred:
            raise AssertionError(f"the lower tier holds {len((held | pending) - referred)} record(s) no node refers "
                                 f"to and misses {len(referred - held - pending)} that nodes refer to")
