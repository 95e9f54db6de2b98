"""A request's prompt KV as pages to move: exported on the prefill engine, checked and imported on
the decode engine, always through the KV manager (it says which pages hold the tokens and holds
the window pages of those within reach of the end).

What moves is the KV of all prompt tokens but the last: the decode engine computes the last one
itself, in its first step, so the first token is drawn where the rest are and the request joins
the decode batch like any sequence whose prefix was cached. For DeepSeek-V4 the pages carry every
component (compressed entries and indexer keys in their pages; the sliding-window KV and the
compressors' open windows in the window pages of the pages within reach of the end).

Only the pages the decode engine lacks move: it takes the prompt's longest cached prefix from its
own prefix cache (as a colocated engine would) and asks for the pages after it. Those it holds
keep the windows they need (a cache hit keeps every window within reach of its end, and the end
of the moved tokens is further on).
"""

from __future__ import annotations

import hashlib

import blake3
import numpy as np
import torch

from ..families.kv_transport import KVExpectation, KVPayload
from ..kv.manager import KVManager
from ..kv.storage import KVCache
from ..sequence import Sequence

DIGEST_BYTES = 16


def page_digest(page) -> bytes:
    """A moved page's digest (any bytes-like object): BLAKE3, a cryptographic hash, since the
    transports authenticate the page headers that carry it, not the bytes themselves, so it must
    not be forgeable (XXH3, the tiers' checksum, is not); 6x BLAKE2b's rate here
    (benchmarks/page_checksums.py)."""
    return blake3.blake3(page).digest(DIGEST_BYTES)


def tokens_to_move(prompt_token_ids: list[int]) -> int:
    return len(prompt_token_ids) - 1


def token_digest(token_ids: list[int]) -> bytes:
    return hashlib.blake2b(np.asarray(token_ids, dtype="<i8").tobytes(), digest_size=16).digest()


def layout_digest(kv: KVCache, window_reach: int) -> bytes:
    """Both engines must lay pages out alike: the same layers, element types, page size and reach."""
    specs = [(s.num_kv_heads, s.head_dim, s.v_head_dim, s.rate, s.windowed, str(s.k_dtype), str(s.v_dtype))
             for s in kv.specs]
    text = repr((specs, kv.page_size, str(kv.dtype), window_reach))
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


def window_flags(kvm: KVManager, num_tokens: int) -> list[bool]:
    """Per page holding ``num_tokens`` tokens: whether its windowed components move too (those
    within reach of the end, the ones the next step reads)."""
    count = -(-num_tokens // kvm.page_size)
    if kvm.window is None:
        return [False] * count
    first, _ = kvm.window.span(num_tokens, num_tokens, kvm.page_size)
    return [i >= first for i in range(count)]


def export_payload(kvm: KVManager, kv: KVCache, seq: Sequence) -> KVPayload:
    """Prefill side, once the prompt is computed: its pages' bytes and checksums."""
    prompt = seq.prompt_token_ids
    n = tokens_to_move(prompt)
    flags = window_flags(kvm, n)
    pages = [b.numpy().tobytes() for b in kv.read_pages(kvm.export_pages(seq)[:len(flags)], flags)]
    return KVPayload(n, token_digest(prompt[:n]), layout_digest(kv, kvm.window_reach), pages,
                     [page_digest(p) for p in pages])


def expectation(kvm: KVManager, kv: KVCache, prompt_token_ids: list[int], first_page: int = 0) -> KVExpectation:
    """Decode side: what the prefill engine must send for this prompt to an engine holding its
    first ``first_page`` pages."""
    n = tokens_to_move(prompt_token_ids)
    return KVExpectation(n, token_digest(prompt_token_ids[:n]), layout_digest(kv, kvm.window_reach),
                         [kv.page_size_bytes(w) for w in window_flags(kvm, n)[first_page:]], first_page)


def checked(payload: KVPayload, expect: KVExpectation) -> str | None:
    """Why a payload is not what was expected, or None: count, digests, sizes and every checksum."""
    if (payload.num_tokens, payload.token_digest, payload.layout, payload.first_page) != \
            (expect.num_tokens, expect.token_digest, expect.layout, expect.first_page):
        return "the pages are of another prompt or page layout"
    if [len(p) for p in payload.pages] != expect.page_sizes or len(payload.checksums) != len(payload.pages):
        return "the pages' number or sizes differ from this engine's"
    for i, (page, checksum) in enumerate(zip(payload.pages, payload.checksums)):
        if page_digest(page) != checksum:
            return f"page {i} failed its checksum"
    return None


def import_payload(kvm: KVManager, kv: KVCache, seq: Sequence, payload: KVPayload) -> None:
    """Decode side: write a checked payload into the pages ``KVManager.import_pages`` gave ``seq``
    past those its prefix cache held."""
    first, flags = payload.first_page, window_flags(kvm, payload.num_tokens)
    blobs = [torch.frombuffer(bytearray(p), dtype=torch.uint8) for p in payload.pages]
    kv.write_pages(kvm.export_pages(seq)[first:len(flags)], flags[first:], blobs)
