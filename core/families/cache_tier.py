"""Cache-tier family: stores KV pages below the device (pinned host memory, files, shared stores).

The interface issue 18 implements (L2 host memory; L3 file, NIXL, Mooncake). Pages are addressed
by content: a hash of the token prefix they end, the model and the page layout, so engines that
share a store share hits. Every page crossing a tier carries a checksum; a page that is absent,
truncated, foreign or fails its checksum is a miss (its tokens are recomputed), never wrong output.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch


def page_checksum(data: torch.Tensor) -> str:
    """A checksum of a page's bytes (all of its KV components, as the tier stores them)."""
    raw = data.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()
    return hashlib.blake2b(raw, digest_size=16).hexdigest()


@dataclass(frozen=True)
class TierPage:
    """A page as a tier holds it."""

    key: str  # content hash: token prefix, model, page layout
    data: torch.Tensor
    checksum: str

    @classmethod
    def of(cls, key: str, data: torch.Tensor) -> TierPage:
        return cls(key, data, page_checksum(data))

    def intact(self) -> bool:
        return page_checksum(self.data) == self.checksum


class CacheTier(ABC):
    """One tier; ``create(ctx)`` of an ``engine_register_cache_tiers`` descriptor builds it."""

    name: str = "?"

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx

    @abstractmethod
    def put(self, pages: list[TierPage]) -> list[bool]:
        """Store pages (atomically each: a reader never sees half a page); False where one was not
        stored (full, unreachable): logged and counted by the caller, serving goes on."""

    @abstractmethod
    def get(self, keys: list[str]) -> list[TierPage | None]:
        """The pages under ``keys``; None for a miss. The caller checks ``intact()``."""

    @abstractmethod
    def contains(self, keys: list[str]) -> int:
        """How many of ``keys``, from the first, the tier holds: the length of a prefix hit, asked
        before a prefetch is worth starting."""
