"""A cache-tier record as bytes, for stores that keep blobs (files, key-value stores).

A header names the record's key, kind, checksum and length before its bytes, so a blob found
under a key is checked to be that key's (a store's mix-up or a stale name is a miss, never
another prefix's KV); the checksum, checked by the caller, catches damaged or truncated bytes.

No copies on the way: ``encode`` gives the header and the record's own bytes as two buffers to
write one after the other, and ``decode`` makes the record's tensor over the buffer the blob was
read into.
"""

from __future__ import annotations

import json

import torch

from ..families.cache_tier import TierPage

MAGIC = b"engine-kv-record 1\n"


def encode(page: TierPage) -> list:
    """The record as buffers to store in order: its header, then its bytes (a view, not a copy)."""
    header = json.dumps({"key": page.key, "kind": page.kind, "checksum": page.checksum,
                         "bytes": page.data.nbytes}).encode()
    return [MAGIC + len(header).to_bytes(4, "little") + header, page.data.contiguous().view(torch.uint8).numpy()]


def decode(key: str, raw) -> TierPage:
    """The record the writable buffer ``raw`` (a bytearray, a uint8 array) holds, its tensor over
    ``raw``'s bytes up to the length its header gives (bytes after it are not the record's);
    ValueError where it is not a record of ``key``."""
    view = memoryview(raw).cast("B")
    start = len(MAGIC) + 4
    if view[:len(MAGIC)] != MAGIC:
        raise ValueError("no record header")
    size = int.from_bytes(view[len(MAGIC):start], "little")
    try:
        header = json.loads(bytes(view[start:start + size]))
        if header["key"] != key:
            raise ValueError(f"a record of {header['key']!r}")
        checksum, kind, end = header["checksum"], header["kind"], start + size + int(header["bytes"])
    except (KeyError, TypeError, UnicodeDecodeError) as exc:
        raise ValueError(f"a broken header ({exc})") from None
    offset, view = start + size, view[:end]  # a buffer longer than the blob (a read of a bound's length) ends there
    data = torch.frombuffer(view, dtype=torch.uint8, offset=offset) if len(view) > offset else \
        torch.empty(0, dtype=torch.uint8)
    return TierPage(key, data, checksum, kind)
