"""Host memory as a cache tier (L2): fixed arenas of record slots, pinned where the KV lives on a GPU.

One arena per record kind, allocated once: ``page_first`` keeps a record's bytes together (one
row per slot), ``layer_first`` keeps each K/V array's segment in an array of its own (one row per
slot in each), as SGLang's host pools do. A slot holds one record and the checksum it was
written with; reads hand back copies, so a slot reused later never changes a page on its way to
the device. Bounded: a put that finds no free slot is refused, and the KV hierarchy
(core/kv/hierarchy.py), which knows what every slot holds, frees room by discarding.
"""

from __future__ import annotations

import torch

from ..families.cache_tier import CacheTier, TierContext, TierPage


class _Arena:
    def __init__(self, segments: tuple[int, ...], count: int, layout: str, pinned: bool) -> None:
        widths = segments if layout == "layer_first" else (sum(segments),)
        self.arrays = [torch.zeros(count, w, dtype=torch.uint8, pin_memory=pinned) for w in widths]
        self.free = list(range(count - 1, -1, -1))
        self.count = count

    def write(self, slot: int, data: torch.Tensor) -> None:
        offset = 0
        for a in self.arrays:
            a[slot].copy_(data[offset:offset + a.shape[1]])
            offset += a.shape[1]

    def read(self, slot: int) -> torch.Tensor:
        return torch.cat([a[slot] for a in self.arrays])


class HostTier(CacheTier):
    name = "host"

    def __init__(self, ctx: TierContext) -> None:
        super().__init__(ctx)
        layout = ctx.engine_config.hicache_mem_layout  # validated by EngineConfig
        pinned = ctx.device.type == "cuda"
        self._arenas = {kind: _Arena(segs, ctx.capacity.get(kind, 0), layout, pinned)
                        for kind, segs in ctx.layout.segments.items()}
        self._slots: dict[str, tuple[str, int, str]] = {}  # key -> (kind, slot, checksum)

    def put(self, pages: list[TierPage]) -> list[bool]:
        done = []
        for p in pages:
            arena = self._arenas[p.kind]
            if p.key not in self._slots:
                if p.data.numel() != self.ctx.layout.record_bytes(p.kind) or not arena.free:
                    done.append(False)
                    continue
                slot = arena.free.pop()
                arena.write(slot, p.data.view(torch.uint8).view(-1))
                self._slots[p.key] = (p.kind, slot, p.checksum)
            done.append(True)
        return done

    def get(self, keys: list[str]) -> list[TierPage | None]:
        out: list[TierPage | None] = []
        for k in keys:
            held = self._slots.get(k)
            out.append(None if held is None else TierPage(k, self._arenas[held[0]].read(held[1]), held[2], held[0]))
        return out

    def contains(self, keys: list[str]) -> int:
        return next((i for i, k in enumerate(keys) if k not in self._slots), len(keys))

    def discard(self, keys: list[str]) -> None:
        for k in keys:
            held = self._slots.pop(k, None)
            if held is not None:
                self._arenas[held[0]].free.append(held[1])

    def free(self, kind: str) -> int:
        return len(self._arenas[kind].free)

    def usage(self) -> tuple[int, int]:
        used = capacity = 0
        for kind, arena in self._arenas.items():
            size = self.ctx.layout.record_bytes(kind)
            used += (arena.count - len(arena.free)) * size
            capacity += arena.count * size
        return used, capacity

    def keys(self) -> set[str]:
        """Every key held (for consistency checks)."""
        return set(self._slots)

    def corrupt(self, key: str, offset: int = 0) -> None:
        """Flip one byte of a held record, as failing memory would (tests of the checksum path)."""
        kind, slot, _ = self._slots[key]
        arena = self._arenas[kind]
        for a in arena.arrays:
            if offset < a.shape[1]:
                a[slot, offset] ^= 0xFF
                return
            offset -= a.shape[1]
        raise IndexError(f"offset past the record of {key!r}")
