"""DeepSeek-V4's cache: its components, laid out in the KV pages of the sequence's one page table.

Per layer, per token: the sliding-window KV (normalised, rotated), and in compressed layers the
compressor's kv and gate projections, so a window that closes in a later chunk pools exactly
what a full pass pools. Per compressed entry (one per ``rate`` tokens): the pooled entry and,
in CSA layers, the indexer's key, kept in the page of the window's last token, which the sequence
that closed the window owns (a shared prefix page is never written). Beside weights in DeepSeek's
published FP8 format the indexer's keys are E4M3 with one fp32 scale each (amax / 448 of the
rotated key), as DeepSeek keeps them: 132 bytes a key at V4-Flash's 128 channels instead of 256.

Being paged like any KV, every component follows the sequence through a prefix hit at any page
boundary (inside a compression window too), a fork's page copy, preemption and abort. The
per-token components are windowed (core/kv/window.py): read only ``window_reach`` tokens behind a
step, they live in window pages that a page keeps only while a sequence's end or a cached
prefix's end is near it, so they cost memory per running request, not per cached token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...forward import ForwardBatch
from ...kv.storage import KVCache, KVLayerSpec
from ...native.quant import FP8
from .topology import CSA2Role


@dataclass(frozen=True)
class LayerCache:
    """Indices, into the KV cache's layers, of one decoder layer's components (None: it has none)."""

    window: int  # per token: k = the KV the sliding window reads
    projections: int | None = None  # per token: k, v = the compressor's kv and gate projections
    entries: int | None = None  # per entry: k = the pooled, normalised, rotated entry (CSA2: maybe another layer's)
    index_projections: int | None = None  # CSA, per token: the indexer compressor's kv and gate
    index_keys: int | None = None  # CSA/CSA2, per entry: k = the indexer's key; v = its fp32 scale if k is E4M3


def cache_layout(head_dim: int, layer_rates: list[int], overlaps: list[bool], index_head_dim: int,
                 fp8_index_keys: bool = False, roles: list[CSA2Role | None] | None = None,
                 ) -> tuple[list[KVLayerSpec], list[LayerCache]]:
    """The KV layer specs of every component and, per decoder layer, where its components are.

    ``layer_rates[i]`` is 0 for a sliding-only layer; ``overlaps[i]`` marks CSA (overlapping
    windows, twice the projection width, and an indexer). ``fp8_index_keys``: the indexer's keys
    in E4M3 with an fp32 scale each; otherwise in the cache's dtype. ``roles[i]`` (V4.1's CSA2,
    topology.py): a KV source keeps its entries (and, if it indexes, the index keys derived from
    them) and, at ratio 2, its per-token projections; a layer reading another's entries keeps
    only its window and points at the source's components, which are stored once.
    """
    key_format = dict(v_head_dim=1, k_dtype=FP8, v_dtype=torch.float32) if fp8_index_keys else dict(v_head_dim=0)
    specs: list[KVLayerSpec] = []

    def add(spec: KVLayerSpec) -> int:
        specs.append(spec)
        return len(specs) - 1

    layers: list[LayerCache] = []
    for i, (rate, overlap) in enumerate(zip(layer_rates, overlaps)):
        window = add(KVLayerSpec(1, head_dim, 0, windowed=True))
        role = roles[i] if roles is not None else None
        if role is not None and role.kv_source < i:
            source = layers[role.kv_source]
            layers.append(LayerCache(window, entries=source.entries, index_keys=source.index_keys))
            continue
        if role is not None:
            parts = dict(entries=add(KVLayerSpec(1, head_dim, 0, rate)))
            if rate > 1:  # a pair that closes in a later step pools what this one projected
                parts["projections"] = add(KVLayerSpec(1, head_dim, head_dim, windowed=True))
            if role.keeps_index_keys:
                parts["index_keys"] = add(KVLayerSpec(1, index_head_dim, rate=rate, **key_format))
            layers.append(LayerCache(window, **parts))
            continue
        if not rate:
            layers.append(LayerCache(window))
            continue
        width = 2 * head_dim if overlap else head_dim
        parts = dict(projections=add(KVLayerSpec(1, width, width, windowed=True)),
                     entries=add(KVLayerSpec(1, head_dim, 0, rate)))
        if overlap:
            parts.update(index_projections=add(KVLayerSpec(1, 2 * index_head_dim, 2 * index_head_dim, windowed=True)),
                         index_keys=add(KVLayerSpec(1, index_head_dim, rate=rate, **key_format)))
        layers.append(LayerCache(window, **parts))
    return specs, layers


def window_reach(sliding_window: int, layer_rates: list[int], overlaps: list[bool]) -> int:
    """Tokens before a step's first one that it reads per token: the window's keys, an open
    compression window's earlier tokens, and an overlapping window's predecessor."""
    return max([sliding_window - 1] + [(2 if o else 1) * r - 1 for r, o in zip(layer_rates, overlaps) if r])


def component_bytes_per_token(specs: list[KVLayerSpec], layers: list[LayerCache], dtype: torch.dtype) -> dict:
    """Bytes one token adds to each component over all layers (an entry counts 1/rate per token; a
    component several layers share counts once)."""
    totals: dict[str, float] = {}
    seen: set[int] = set()
    for layer in layers:
        for name in ("window", "projections", "entries", "index_projections", "index_keys"):
            i = getattr(layer, name)
            if i is not None and i not in seen:
                seen.add(i)
                totals[name] = totals.get(name, 0.0) + specs[i].slot_bytes(dtype) / specs[i].rate
    return totals


@dataclass(frozen=True)
class SeqView:
    """One sequence of a batch: where its new tokens are in the packed axis and its page table row."""

    start: int  # first row of its new tokens in the batch
    context: int  # tokens already cached
    new: int  # tokens this step brings
    pages: torch.Tensor  # [max_pages] int32
    windows: torch.Tensor  # [num_pages] int32: each page's window page
    page_size: int
    floor: int = 0  # the first position whose window KV its queries may read (ForwardBatch.window_floors_cpu)

    @property
    def end(self) -> int:
        return self.context + self.new  # the sequence's length after the step

    def token_slots(self, first: int, end: int) -> torch.Tensor:
        """Flat slots, in a windowed layer viewed as [num_window_pages * page_size, ...], of
        positions first..end-1 (their pages must have window pages)."""
        pos = torch.arange(first, end, device=self.pages.device)
        return self.windows[self.pages[pos // self.page_size].long()].long() * self.page_size + pos % self.page_size

    def entry_slots(self, first: int, end: int, rate: int) -> torch.Tensor:
        """Flat slots, in a rate-``rate`` layer viewed as [num_pages * slots_per_page, ...], of
        entries first..end-1: each in the page of its window's last token."""
        w = torch.arange(first, end, device=self.pages.device)
        page = (w * rate + rate - 1) // self.page_size
        per_page = -(-self.page_size // rate)
        return self.pages[page].long() * per_page + w - page * self.page_size // rate


def sequences(batch: ForwardBatch, windows: torch.Tensor) -> list[SeqView]:
    """The batch's sequences that bring tokens this step."""
    views, start = [], 0
    floors = batch.window_floors_cpu or [0] * batch.num_seqs
    for i, (context, new) in enumerate(zip(batch.context_lens_cpu, batch.query_lens_cpu)):
        if new:
            views.append(SeqView(start, context, new, batch.page_table[i], windows, batch.page_size, floors[i]))
        start += new
    return views


def window_slots(slot_mapping: torch.Tensor, windows: torch.Tensor, page_size: int) -> torch.Tensor:
    """A batch's token slots (page * page_size + offset) in the window pages instead."""
    return windows[slot_mapping // page_size].long() * page_size + slot_mapping % page_size


def flat(kv: KVCache, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's K and V with their slots on one axis: [slots, width]."""
    layer = kv.layer(index)
    return tuple(t.view(t.shape[0] * t.shape[1], t.shape[-1]) for t in (layer.k, layer.v))


def entries_of(kv: KVCache, index: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A compressed layer's entries [slots, d] as it keeps them, and their fp32 scales [slots] (a view
    of its V) where the entries are E4M3 (None otherwise)."""
    entries, v = flat(kv, index)
    if entries.dtype != FP8:
        return entries, None
    if v.dtype != torch.float32 or v.shape[1] != 1:
        raise ValueError(f"cache layer {index} keeps E4M3 entries, so its V must be one float32 scale per entry, "
                         f"not {v.shape[1]} {v.dtype}")
    return entries, v[:, 0]
