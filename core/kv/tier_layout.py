"""What a cache tier below the device keeps for a KV cache: each kind of record (a page's
components, a window page's where the model has windows, a proposer's rows of a page where it keeps
some: page_rows.py) with its layout, the model key the records' content keys are named by, and how
many records of each kind host memory holds."""

from __future__ import annotations

import json

from ..families.cache_tier import CHECKSUM, TierLayout
from .page_rows import KIND as ROWS
from .page_rows import PageRows
from .storage import KVCache


def tier_layout(kv: KVCache, model: str, rows: PageRows | None = None) -> TierLayout:
    """The records a tier keeps for ``kv`` (a page's components, and a window page's where there are
    windows; a proposer's ``rows`` of a page where it keeps some), named in content keys by
    ``model``, those records' layout and how they are checked. Rows have keys of their own: the
    pages' keys are the same with or without them."""
    segments = {"page": kv.record_segments()}
    if kv.num_window_pages:
        segments["window"] = kv.record_segments(windowed=True)
    model = json.dumps([model, segments, CHECKSUM], sort_keys=True)
    if rows is not None:
        segments[ROWS] = (rows.record_bytes,)
    return TierLayout(segments, model)


def host_capacity(kv: KVCache, layout: TierLayout, ratio: float, size_bytes: int = 0) -> dict[str, int]:
    """Records of each kind host memory keeps: ``ratio`` times the device's pages (and window
    pages, and a rows record a page), or as many as ``size_bytes`` holds in the same proportion."""
    device = {"page": kv.num_pages - 1, "window": kv.num_window_pages - 1, ROWS: kv.num_pages - 1}
    device = {k: n for k, n in device.items() if k in layout.segments}
    if size_bytes:
        ratio = size_bytes / sum(n * layout.record_bytes(k) for k, n in device.items())
    return {k: int(n * ratio) for k, n in device.items()}


def window_keys(end_key: str, num_pages: int) -> list[str]:
    """The keys of the window records of a prefix's tail, named after the key of its last page."""
    return [f"{end_key}:w{i}" for i in range(num_pages)]
