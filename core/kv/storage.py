"""The KV tensors: one K and one V page array per layer, indexed by the pool's page ids.

A "layer" here is one component of the cache. Most keep a slot per token; a compressed one
(``rate`` > 1, DeepSeek-V4's pooled entries) keeps a slot per ``rate`` tokens, so its page
holds ``ceil(page_size / rate)`` slots and is paged, shared and freed with the tokens it covers.
A windowed one lives in the smaller pool of window pages (window.py): page ``p``'s tokens are in
window page ``window_table()[p]``. A layer may keep its K and V in element types of its own (E4M3
keys beside their fp32 scales, say); the others keep the cache's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..families.attention import LayerKV
from ..to_device import to_device
from .host_copy import HostCopy, to_host
from .layer_loads import LayerLoads


@dataclass(frozen=True)
class KVLayerSpec:
    """What one layer keeps per slot; ``v_head_dim == 0`` means no V (a layer sharing another's KV).
    A slot covers ``rate`` tokens (1: one per token)."""

    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    rate: int = 1
    windowed: bool = False  # read only near a sequence's end: kept in window pages
    k_dtype: torch.dtype | None = None  # K's element type; None: the cache's
    v_dtype: torch.dtype | None = None  # V's element type; None: the cache's

    def slots_per_page(self, page_size: int) -> int:
        return -(-page_size // self.rate)

    def dtypes(self, dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
        """K's and V's element types in a cache of ``dtype``."""
        return self.k_dtype or dtype, self.v_dtype or dtype

    def slot_bytes(self, dtype: torch.dtype) -> int:
        """K and V bytes of one slot in a cache of ``dtype``."""
        k, v = self.dtypes(dtype)
        return self.num_kv_heads * (self.head_dim * k.itemsize + self.v_head_dim * v.itemsize)


class KVCache:
    """Zero-initialised pages (a padded slot or the null page reads as zeros, never NaN garbage)."""

    def __init__(self, layers: list[KVLayerSpec], num_pages: int, page_size: int, dtype: torch.dtype,
                 device: torch.device | str, num_window_pages: int = 0) -> None:
        if num_pages < 2:
            raise ValueError(f"a KV cache needs at least 2 pages (the null page and one usable), got {num_pages}")
        self.specs = list(layers)
        self.num_pages = num_pages
        self.page_size = page_size
        self.dtype = dtype
        self.device = torch.device(device)
        if any(s.windowed for s in self.specs) and num_window_pages < 2:
            raise ValueError(f"windowed layers need at least 2 window pages, got {num_window_pages}")
        self.num_window_pages = num_window_pages
        self._layers = [self._allocate(s, num_window_pages if s.windowed else num_pages) for s in self.specs]
        self._window_table = torch.zeros(num_pages, dtype=torch.int32, device=self.device)
        self._staged: dict[int, int] = {}
        self.loads = LayerLoads(self.device, self._layer_columns())  # host-memory hits, loaded beside the forward

    def _allocate(self, spec: KVLayerSpec, pages: int) -> LayerKV:
        k, v = spec.dtypes(self.dtype)
        shape = (pages, spec.slots_per_page(self.page_size), spec.num_kv_heads)
        return LayerKV(k=torch.zeros(*shape, spec.head_dim, dtype=k, device=self.device),
                       v=torch.zeros(*shape, spec.v_head_dim, dtype=v, device=self.device))

    @property
    def num_layers(self) -> int:
        return len(self._layers)

    def layer(self, i: int) -> LayerKV:
        """Layer ``i``'s K and V, with the pages loaded into them for this step in (layer_loads.py)."""
        self.loads.wait(i)
        return self._layers[i]

    def stage_window(self, page: int, window_page: int) -> None:
        """Record that ``page``'s window is now ``window_page`` (0: none); sent with the next read."""
        self._staged[page] = window_page

    def staged_windows(self) -> list[tuple[int, int]]:
        """The (page, window page) changes not yet applied: what the other tensor-parallel ranks'
        caches must stage too before the next step."""
        return list(self._staged.items())

    def window_table(self) -> torch.Tensor:
        """[num_pages] int32 on the device: each page's window page, staged changes applied."""
        if self._staged:
            pages, windows = zip(*self._staged.items())
            self._window_table[to_device(pages, torch.int64, self.device)] = to_device(windows, torch.int32, self.device)
            self._staged.clear()
        return self._window_table

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        """Copy page ``src[j]`` onto ``dst[j]`` in every layer (a forked sequence's partial last page);
        windowed layers copy between the pages' window pages. Pages move as bytes, whatever a
        layer's element types (the CPU has no index_copy_ for E4M3)."""
        if len(src) != len(dst):
            raise ValueError(f"{len(src)} source pages but {len(dst)} destinations")
        if len(set(dst)) != len(dst):
            raise ValueError(f"destination pages repeat: {dst}")
        if not src:
            return
        self.loads.flush()
        src_idx, dst_idx = to_device(src, torch.int64, self.device), to_device(dst, torch.int64, self.device)
        if self.num_window_pages:
            table = self.window_table()
            windows = (table[src_idx].long(), table[dst_idx].long())
        for spec, kv in zip(self.specs, self._layers):
            s, d = windows if spec.windowed else (src_idx, dst_idx)
            for t in (kv.k.view(torch.uint8), kv.v.view(torch.uint8)):
                t.index_copy_(0, d, t.index_select(0, s))

    def _byte_rows(self):
        """(spec, [pages, bytes] uint8 view) for the K and the V of every layer that keeps bytes."""
        for _, spec, rows in self._indexed_rows():
            yield spec, rows

    def _indexed_rows(self):
        """(layer index, spec, [pages, bytes] uint8 view) for the K and the V of every layer that keeps bytes."""
        for i, (spec, kv) in enumerate(zip(self.specs, self._layers)):
            for t in (kv.k, kv.v):
                width = t[0].numel() * t.element_size()
                if width:
                    yield i, spec, t.view(torch.uint8).view(t.shape[0], width)

    def _layer_columns(self) -> dict[int, list[tuple[torch.Tensor, int, int]]]:
        """Per layer that is not windowed: its K and V [pages, bytes] views, each with its bytes' offset
        and width in a page's record (``record_segments`` order)."""
        columns: dict[int, list[tuple[torch.Tensor, int, int]]] = {}
        offset = 0
        for i, spec, rows in self._indexed_rows():
            if not spec.windowed:
                columns.setdefault(i, []).append((rows, offset, rows.shape[1]))
                offset += rows.shape[1]
        return columns

    def page_size_bytes(self, with_window: bool) -> int:
        """Bytes of one page's blob (``read_pages``), with or without its windowed layers' part."""
        return sum(rows.shape[1] for spec, rows in self._byte_rows() if with_window or not spec.windowed)

    def read_pages(self, pages: list[int], with_window: list[bool]) -> list[torch.Tensor]:
        """One uint8 host tensor per page: every layer's K then V bytes in order; a windowed layer's
        (through the window table) only where ``with_window``, whose pages must have a window page.
        For another engine (prefill/decode disaggregation): the layout is what ``write_pages`` reads."""
        if len(pages) != len(with_window):
            raise ValueError(f"{len(pages)} pages but {len(with_window)} window flags")
        self.loads.flush()
        idx = to_device(pages, torch.int64, self.device)
        windows = self._windows(pages, with_window, idx)
        parts = []
        for spec, rows in self._byte_rows():
            got = rows.index_select(0, windows if spec.windowed else idx).cpu()
            parts.append((spec.windowed, got))
        return [torch.cat([p[i] for w, p in parts if with_window[i] or not w]) for i in range(len(pages))]

    def write_pages(self, pages: list[int], with_window: list[bool], blobs: list[torch.Tensor]) -> None:
        """Write blobs ``read_pages`` made (of an engine with this layout) into ``pages``."""
        if not len(pages) == len(with_window) == len(blobs):
            raise ValueError(f"{len(pages)} pages, {len(with_window)} window flags, {len(blobs)} blobs")
        for blob, w in zip(blobs, with_window):
            if blob.dtype != torch.uint8 or blob.numel() != self.page_size_bytes(w):
                raise ValueError(f"a page blob of {blob.numel()} bytes ({blob.dtype}); this layout's is "
                                 f"{self.page_size_bytes(w)}")
        if not pages:
            return
        self.loads.flush()
        idx = to_device(pages, torch.int64, self.device)
        windows = self._windows(pages, with_window, idx)
        offsets = [0] * len(pages)
        for spec, rows in self._byte_rows():
            take = [i for i in range(len(pages)) if with_window[i] or not spec.windowed]
            if not take:
                continue
            width = rows.shape[1]
            src = torch.stack([blobs[i][offsets[i]:offsets[i] + width] for i in take]).to(self.device)
            for i in take:
                offsets[i] += width
            dst = windows if spec.windowed else idx
            rows.index_copy_(0, dst[to_device(take, torch.int64, self.device)], src)

    def _windows(self, pages: list[int], with_window: list[bool], idx: torch.Tensor) -> torch.Tensor:
        """The window page of each page (0 where not ``with_window``); a flagged page without one is an error."""
        if not self.num_window_pages:
            return idx
        windows = self.window_table()[idx].long() * to_device(with_window, torch.int64, self.device)
        missing = [p for p, w, win in zip(pages, with_window, windows.tolist()) if w and win == 0]
        if missing:
            raise ValueError(f"pages {missing[:8]} have no window page")
        return windows

    def _parts(self, windowed: bool) -> list[torch.Tensor]:
        """Every K and V array of the (windowed or other) layers as [pages, bytes] views, in order."""
        return [rows for spec, rows in self._byte_rows() if spec.windowed == windowed]

    def record_segments(self, windowed: bool = False) -> tuple[int, ...]:
        """The bytes of one page's record in each K and V array (windowed layers: of a window page)."""
        return tuple(t.shape[1] for t in self._parts(windowed))

    def read_records(self, rows: list[int], windowed: bool = False) -> torch.Tensor:
        """[len(rows), record bytes] uint8 on the host: pages ``rows`` (window pages, if ``windowed``)
        in every K and V array, concatenated in ``record_segments`` order. Waits for the device."""
        return self.copy_records(rows, windowed).wait()

    def copy_records(self, rows: list[int], windowed: bool = False) -> HostCopy:
        """``read_records``' records, copied to the host behind the work queued so far (host_copy.py):
        the pages may be reused at once, and nothing waits for the device until the copy is asked for."""
        if not windowed:
            self.loads.flush()
        idx = to_device(rows, torch.int64, self.device)
        return to_host(torch.cat([t.index_select(0, idx) for t in self._parts(windowed)], dim=1))

    def write_records(self, rows: list[int], records: torch.Tensor, windowed: bool = False) -> None:
        """Write ``records`` (as ``read_records`` returns them, on the host) into pages ``rows``: window
        pages now, queued behind the work so far; pages as the next forward reaches each layer
        (layer_loads.py), or before anything else reads them."""
        idx = to_device(rows, torch.int64, self.device)
        if not windowed:
            self.loads.stage(idx, records)
            return
        records = records.to(self.device, non_blocking=True)
        offset = 0
        for t in self._parts(windowed):
            t.index_copy_(0, idx, records[:, offset:offset + t.shape[1]])
            offset += t.shape[1]

    @staticmethod
    def bytes_per_page(layers: list[KVLayerSpec], page_size: int, dtype: torch.dtype, windowed: bool = False) -> int:
        """K and V bytes one page (or one window page) takes across its layers."""
        return sum(s.slots_per_page(page_size) * s.slot_bytes(dtype) for s in layers if s.windowed == windowed)


def pages_for_budget(budget_bytes: int, layers: list[KVLayerSpec], page_size: int, dtype: torch.dtype) -> int:
    """How many pages (the null page included) fit in ``budget_bytes``."""
    per_page = KVCache.bytes_per_page(layers, page_size, dtype)
    if per_page <= 0:
        raise ValueError("the KV layers keep no bytes per token")
    pages = budget_bytes // per_page
    if pages < 2:
        raise ValueError(
            f"KV cache budget of {budget_bytes} bytes holds {pages} page(s); at least 2 are needed (the null "
            f"page and one usable), and one page of {page_size} tokens over {len(layers)} layers needs "
            f"{per_page} bytes ({per_page / 2**20:.2f} MiB), so at least {2 * per_page} bytes")
    return pages
