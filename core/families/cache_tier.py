"""Cache-tier family: stores KV pages below the device (host memory, files, shared stores).

Pages are addressed by content: a hash of the token prefix they end, the model and the page
layout, so engines that share a store share hits. A page travels as one record: its bytes in
every KV component (``TierLayout`` says which segments, in order), and a checksum taken when it
was written. A record that is absent, truncated, foreign or fails its checksum is a miss (its
tokens are recomputed), never wrong output; one there but bad is counted, and dropped from the
tier (``reject``) so a good one can take its place.

Records come in kinds of fixed size: ``"page"`` (a KV page's components that live with its
tokens) and, for models with windowed components (DeepSeek-V4's sliding window and compressor
state, core/kv/window.py), ``"window"`` (one page's windowed components).
"""

from __future__ import annotations

import hashlib
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import xxhash

logger = logging.getLogger(__name__)

CHECKSUM = "xxh3-128"  # named in the tiers' content keys (kv/tier_layout.py): records checked otherwise never meet


def page_checksum(data: torch.Tensor) -> str:
    """A checksum of a record's bytes (all of its KV components, as the tier stores them): XXH3's
    128 bits, against damage (a flipped bit, a torn or cut-short write), at tens of GB/s a core
    (benchmarks/page_checksums.py; BLAKE2b's 0.3 GB/s bounded a load's host side). Not a defence
    against a forger: whoever can write a record can write its checksum too."""
    raw = data.detach().contiguous().cpu().view(torch.uint8).numpy()  # hashed in place, not copied to bytes
    return xxhash.xxh3_128_hexdigest(raw)


def prefix_keys(tokens: list[int], page_size: int, model: str) -> list[str]:
    """The content key of every whole page of ``tokens``: a hash chained over the pages, seeded by
    ``model`` (the model and page layout), so a key names the whole prefix its page ends."""
    digest = hashlib.blake2b(model.encode(), digest_size=16).digest()
    keys = []
    for start in range(0, len(tokens) // page_size * page_size, page_size):
        page = np.asarray(tokens[start:start + page_size], dtype=np.int64).tobytes()
        digest = hashlib.blake2b(digest + page, digest_size=16).digest()
        keys.append(digest.hex())
    return keys


@dataclass(frozen=True)
class TierPage:
    """A record as a tier holds it."""

    key: str  # content hash: token prefix, model, page layout
    data: torch.Tensor
    checksum: str
    kind: str = "page"

    @classmethod
    def of(cls, key: str, data: torch.Tensor, kind: str = "page") -> TierPage:
        return cls(key, data, page_checksum(data), kind)

    def intact(self) -> bool:
        return page_checksum(self.data) == self.checksum


@dataclass(frozen=True)
class TierLayout:
    """What a tier stores: per record kind, its byte segments in order (one per KV component part,
    so a layer-first store can keep each in an array of its own); ``model`` names the model and
    layout in content keys."""

    segments: dict[str, tuple[int, ...]]
    model: str = ""

    def record_bytes(self, kind: str) -> int:
        return sum(self.segments[kind])


@dataclass(frozen=True)
class TierContext:
    """What a tier's ``check`` and ``create`` see: the selection context's fields, the layout, and
    how many records of each kind it may keep (a bounded tier such as host memory)."""

    platform: Any
    model_config: Any
    engine_config: Any
    layout: TierLayout
    capacity: dict[str, int] = field(default_factory=dict)
    device: torch.device = torch.device("cpu")  # where the KV pages live (pinned host memory for CUDA)


class CacheTier(ABC):
    """One tier; ``create(ctx)`` of an ``engine_register_cache_tiers`` descriptor builds it."""

    name: str = "?"

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx
        self.rejected = 0  # blobs found under a key that were not a record of it (a miss; counted)
        self.read_failures = 0  # reads that failed other than by absence (an unreachable store; a miss)
        self.last_error: str | None = None  # why the last write or read failed, for the caller's log

    @abstractmethod
    def put(self, pages: list[TierPage]) -> list[bool]:
        """Store pages (atomically each: a reader never sees half a page); False where one was not
        stored (full, unreachable; ``last_error`` says why): logged and counted by the caller,
        serving goes on."""

    @abstractmethod
    def get(self, keys: list[str]) -> list[TierPage | None]:
        """The pages under ``keys``; None for a miss. The caller checks ``intact()``."""

    @abstractmethod
    def contains(self, keys: list[str]) -> int:
        """How many of ``keys``, from the first, the tier holds: the length of a prefix hit, asked
        before a prefetch is worth starting."""

    def reject(self, key: str) -> None:
        """The record read under ``key`` failed its checksum: remove it where the tier can, so a
        good one can be written in its place (a shared store's bad copy is bad for every engine).
        By default nothing happens."""

    def discard(self, keys: list[str]) -> None:
        """Forget the records under ``keys`` (a bounded tier frees their room). A shared store may
        keep them for other engines: by default nothing happens."""

    def free(self, kind: str) -> int | None:
        """How many more records of ``kind`` fit; None where the tier does not know (a shared store)."""
        return None

    def usage(self) -> tuple[int, int] | None:
        """(bytes used, capacity in bytes) for the metrics' gauges; None where the tier cannot say."""
        return None

    def _read_failed(self, why: str) -> None:
        """A read that failed other than by absence (an unreachable store): counted, logged (the
        first and every thousandth), a miss."""
        self.read_failures += 1
        self.last_error = why
        if self.read_failures == 1 or self.read_failures % 1000 == 0:
            logger.warning("hierarchical cache: reading the %s tier failed (%s; %d failed reads so far); a miss",
                           self.name, why, self.read_failures)
