"""A bound on a shared record directory's size: the least recently used records go first.

Several engines (processes, machines on one mount) write the directory, none knowing what the
others wrote, so each keeps an estimate (the size it last saw plus what it wrote since) and looks
again (a scan) once that passes the bound or it has written ``SLACK`` of the bound since: then,
if the directory is over, it deletes records, least recently used first (a read touches a record:
file.py), until the directory is at ``LOW_WATER`` of the bound. So the directory stays within the
bound but for what the other engines wrote since this one last looked (under ``SLACK`` each).

Deleting is only ``unlink``: a record is whole under its name or not there, an engine reading it
meanwhile keeps its open copy, and one opening it after finds nothing (a miss). A record another
engine is writing is still a temporary file and never a candidate; a temporary file older than
``STALE_TMP_S`` is a write whose process died and is deleted. Records vanishing during a scan
(another engine evicting too) are skipped.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

logger = logging.getLogger(__name__)

LOW_WATER = 0.9  # eviction frees the directory down to this fraction of the bound
SLACK = 0.1  # of the bound: how much an engine writes before it looks at the directory again
STALE_TMP_S = 600.0  # a temporary file this old is a dead write (a write takes milliseconds)
TMP_PREFIX = ".tmp-"


class DirectoryBound:
    def __init__(self, root: Path, max_bytes: int) -> None:
        self.root, self.max_bytes = root, max_bytes
        self.evicted = 0  # records this engine deleted for room
        self._seen: int | None = None  # bytes the directory held after the last scan
        self._since = 0  # bytes written since

    def wrote(self, size: int) -> None:
        self._since += size

    def keep(self) -> None:
        """Bring the directory within the bound if the estimate says it may be over (after writes)."""
        if self._seen is not None and self._seen + self._since <= self.max_bytes and \
                self._since < SLACK * self.max_bytes:
            return
        records, total = self._scan()
        if total > self.max_bytes:
            records.sort()
            goal, freed = LOW_WATER * self.max_bytes, 0
            for _, size, path in records:
                if total - freed <= goal:
                    break
                try:
                    os.unlink(path)
                    self.evicted += 1
                except FileNotFoundError:  # another engine evicted it first
                    pass
                except OSError as exc:
                    logger.warning("hierarchical cache: evicting %s failed (%s)", path, exc)
                    continue
                freed += size
            total -= freed
        self._seen, self._since = total, 0

    def _scan(self) -> tuple[list[tuple[float, int, str]], int]:
        """(mtime in ns, size, path) of every record, and the bytes of the records and of the writes under
        way; stale temporary files are deleted."""
        records, total, now = [], 0, time.time()
        try:
            shards = list(os.scandir(self.root))
        except OSError:
            return records, total
        for shard in shards:
            try:
                entries = list(os.scandir(shard.path)) if shard.is_dir(follow_symlinks=False) else []
            except OSError:  # gone meanwhile
                continue
            for e in entries:
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                if e.name.startswith(TMP_PREFIX):
                    if now - st.st_mtime > STALE_TMP_S:
                        try:
                            os.unlink(e.path)
                        except OSError:
                            pass
                    else:
                        total += st.st_size
                elif e.name.endswith(".kv"):
                    records.append((st.st_mtime_ns, st.st_size, e.path))
                    total += st.st_size
        return records, total
