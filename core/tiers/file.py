"""A directory as a cache tier (L3): one file per record, shared by every engine that mounts it.

A record is stored under its content key (the prefix it ends, the model, the page layout;
cache_tier.prefix_keys), so engines of the same model share hits and different models never meet.
Each file is written whole to a temporary name in the same directory and renamed into place
(atomic on a POSIX file system, NFS included), so a reader sees a complete record or none, and
engines writing the same record at once each rename a complete copy. The file carries a header
(record.py): a file that is not a record, or names another key (foreign), is a miss; a truncated
one fails its checksum where the caller checks it. A write that fails (a full disk, a gone mount)
is logged and refused, and a read that fails other than by absence is a counted miss; serving
goes on. A read that hits a record touches it (its modification time), and with a size bound
(``--hicache-storage-max-size``) the writing engine deletes the least recently used records once
the directory outgrows it (``bound.py``). Otherwise records are deleted only when bad (``reject``:
not a record of their key, or failing their checksum). A ``get`` of many records reads their files
one after another (8 threads reading them side by side were no faster on a local disk: the work
is the CPU's). Subclasses may move the bytes their own way (``_write``, ``_read_many``: NIXL's file
plugins, one transfer for a get's files).
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from ..families.cache_tier import CacheTier, TierContext, TierPage
from .bound import TMP_PREFIX, DirectoryBound
from .record import decode, encode

logger = logging.getLogger(__name__)

USAGE_EVERY_S = 1.0  # how often the usage gauges ask the file system


def file_reasons(ctx) -> list[str]:
    """Why the file tier cannot serve this config (empty: it can)."""
    directory = getattr(ctx.engine_config, "hicache_storage_dir", None)
    if not directory:
        return ["--hicache-storage-dir names no directory"]
    path = Path(directory).expanduser()
    probe = path
    while not probe.exists():  # the directory is made at start-up: the nearest existing one must allow it
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK):
        return [f"{path} is not a writable directory"]
    return []


def record_name(key: str) -> str:
    """Where the record of ``key`` lies below the store's root (a directory, a bucket)."""
    name = key.replace(":", "-")
    return f"{name[:2]}/{name}.kv"


class FileTier(CacheTier):
    name = "file"

    def __init__(self, ctx: TierContext) -> None:
        super().__init__(ctx)
        self.root = Path(ctx.engine_config.hicache_storage_dir).expanduser()
        self.root.mkdir(parents=True, exist_ok=True)
        self.failed_writes = 0
        max_size = getattr(ctx.engine_config, "hicache_storage_max_size", 0)
        self.bound = DirectoryBound(self.root, int(max_size * 2**30)) if max_size else None
        self._usage: tuple[float, tuple[int, int] | None] = (float("-inf"), None)

    def _path(self, key: str) -> Path:
        return self.root / record_name(key)

    def put(self, pages: list[TierPage]) -> list[bool]:
        done = [self._put(p) for p in pages]
        if self.bound is not None:
            self.bound.keep()
        return done

    def _put(self, page: TierPage) -> bool:
        path = self._path(page.key)
        if _touch(path):  # there already (another engine wrote it): now recently used
            return True
        tmp = None
        try:
            path.parent.mkdir(exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=TMP_PREFIX)
            parts = encode(page)
            self._write(fd, parts)
            os.replace(tmp, path)
            if self.bound is not None:
                self.bound.wrote(sum(memoryview(p).nbytes for p in parts))
            return True
        except OSError as exc:
            self.failed_writes += 1
            self.last_error = f"writing {path}: {exc}"
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
            return False

    def _write(self, fd: int, parts: list) -> None:
        """Write ``parts`` (buffers, in order) to the open file ``fd`` (a new, empty file) and close
        it; a large part goes to the file from where it is, not through a copy."""
        with os.fdopen(fd, "wb") as f:
            for part in parts:
                f.write(part)

    def _read(self, path: Path) -> np.ndarray:
        """The file's bytes, read once into an uninitialised buffer the record then lies over."""
        with open(path, "rb", buffering=0) as f:
            buffer = np.empty(os.fstat(f.fileno()).st_size, dtype=np.uint8)
            view, got = memoryview(buffer), 0
            while got < len(buffer) and (n := f.readinto(view[got:])):
                got += n
        return buffer[:got]  # shorter where the file shrank meanwhile: it fails its checksum

    def _read_many(self, paths: list[Path]) -> list[np.ndarray | OSError]:
        """Each file's bytes, or the OSError reading it (a get's files: subclasses may read them in
        one request)."""
        return [_read_or_error(self._read, p) for p in paths]

    def get(self, keys: list[str]) -> list[TierPage | None]:
        return [self._record(k, raw) for k, raw in zip(keys, self._read_many([self._path(k) for k in keys]))]

    def _record(self, key: str, raw: np.ndarray | OSError) -> TierPage | None:
        """The record ``raw`` (a file's bytes, or why it could not be read) holds for ``key``; None for a miss."""
        if isinstance(raw, OSError):
            if raw.errno != errno.ENOENT:
                self.read_failures += 1
                if self.read_failures == 1 or self.read_failures % 1000 == 0:
                    logger.warning("hierarchical cache: reading %s failed (%s; %d failed reads so far); a miss",
                                   self._path(key), raw, self.read_failures)
            return None
        try:
            record = decode(key, raw)
        except ValueError as exc:
            self.rejected += 1
            logger.warning("hierarchical cache: %s is not a record of its key (%s); a miss, removed",
                           self._path(key), exc)
            self.reject(key)
            return None
        _touch(self._path(key))
        return record

    def reject(self, key: str) -> None:
        """Remove the file (atomic: an engine reading it meanwhile keeps its copy), so the next
        engine to store the prefix writes a good one; where it cannot be removed, it stays a miss."""
        try:
            self._path(key).unlink(missing_ok=True)
        except OSError as exc:
            self.last_error = f"removing {self._path(key)}: {exc}"

    def usage(self) -> tuple[int, int] | None:
        """The file system's bytes used and size (the directory is shared: its own size is not
        this engine's to know cheaply), asked at most once a second."""
        at, usage = self._usage
        if time.monotonic() - at >= USAGE_EVERY_S:
            try:
                du = shutil.disk_usage(self.root)
                usage = (du.used, du.total)
            except OSError:
                usage = None
            self._usage = (time.monotonic(), usage)
        return usage

    def contains(self, keys: list[str]) -> int:
        """A stat a key, of a path made as a string (128 keys: 0.7-1 ms here, 3-11 ms through
        pathlib's objects; benchmarks/hicache_l3_writes.py). Neither a listing nor an index: a
        shard directory's listing grows with the store (the 128 keys' shards listed: 76-135 ms
        beside 80,000 records), and an index goes stale as other engines write and evict."""
        root = os.fspath(self.root)
        for i, key in enumerate(keys):
            try:
                os.stat(f"{root}/{record_name(key)}")
            except OSError:  # absent (or unreadable: a miss either way)
                return i
        return len(keys)


def _read_or_error(read, path: Path):
    """``read(path)``, or the OSError it raised."""
    try:
        return read(path)
    except OSError as exc:
        return exc


def _touch(path: Path) -> bool:
    """Mark the record at ``path`` recently used (what the size bound evicts by); whether it is there."""
    try:
        os.utime(path)
        return True
    except OSError:
        return False
