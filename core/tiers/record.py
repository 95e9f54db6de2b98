"""A cache-tier record as bytes, for stores that keep blobs (files, key-value stores).

A header names the record's key, kind, checksum and length before its bytes, so a blob found
under a key is checked to be that key's (a store's mix-up or a stale name is a miss, never
another prefix's KV); the checksum, checked by the caller, catches damaged or truncated bytes.
"""

from __future__ import annotations

import json

import torch

from ..families.cache_tier import TierPage

MAGIC = b"engine-kv-record 1\n"


def encode(page: TierPage) -> bytes:
    header = json.dumps({"key": page.key, "kind": page.kind, "checksum": page.checksum,
                         "bytes": page.data.numel()}).encode()
    return MAGIC + len(header).to_bytes(4, "little") + header + page.data.contiguous().view(torch.uint8).numpy().tobytes()


def decode(key: str, raw: bytes) -> TierPage:
    """The record ``raw`` holds; ValueError where it is not a record of ``key``."""
    start = len(MAGIC) + 4
    if not raw.startswith(MAGIC):
        raise ValueError("no record header")
    size = int.from_bytes(raw[len(MAGIC):start], "little")
    try:
        header = json.loads(raw[start:start + size])
        if header["key"] != key:
            raise ValueError(f"a record of {header['key']!r}")
        checksum, kind = header["checksum"], header["kind"]
    except (KeyError, TypeError, UnicodeDecodeError) as exc:
        raise ValueError(f"a broken header ({exc})") from None
    return TierPage(key, torch.frombuffer(bytearray(raw[start + size:]), dtype=torch.uint8), checksum, kind)
