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

A decode engine whose proposer drafts from the target's features of the prompt (MTP: the residual
streams) gets those of the prompt's last moved positions too (``SpecProposer.carried``), as one
more blob after the pages: a flag (whether the prefill engine computed them all) and the rows. Both
engines must be started with the same ``speculative_config``: the layout digest says what rides,
so a pair that differs is refused as another page layout.
"""

from __future__ import annotations

import hashlib

import blake3
import numpy as np
import torch

from ..families.kv_transport import KVExpectation, KVPayload
from ..families.spec import SpecProposer
from ..kv.manager import KVManager
from ..kv.storage import KVCache
from ..sequence import Sequence

DIGEST_BYTES = 16
FLAG_BYTES = 8  # before the carried features: 1 where they follow, 0 where the prefill engine has none


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


def carrier(speculator) -> SpecProposer | None:
    """The proposer whose features move with the KV (``SpecProposer.carried``), if any."""
    proposer = speculator.proposer if speculator is not None else None
    return proposer if proposer is not None and proposer.carried else None


def layout_digest(kv: KVCache, window_reach: int, proposer: SpecProposer | None = None) -> bytes:
    """Both engines must lay pages out alike: the same layers, element types, page size and reach,
    and the same features carried."""
    specs = [(s.num_kv_heads, s.head_dim, s.v_head_dim, s.rate, s.windowed, str(s.k_dtype), str(s.v_dtype))
             for s in kv.specs]
    carried = (proposer.carried, proposer.carried_row, str(proposer.carried_dtype)) if proposer is not None else None
    text = repr((specs, kv.page_size, str(kv.dtype), window_reach, carried))
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


def carried_span(proposer: SpecProposer, num_tokens: int) -> tuple[int, int]:
    """The positions whose features move: the last ``carried`` of the moved tokens."""
    return max(0, num_tokens - proposer.carried), num_tokens


def carried_bytes(proposer: SpecProposer, num_tokens: int) -> int:
    a, b = carried_span(proposer, num_tokens)
    return FLAG_BYTES + (b - a) * proposer.carried_row * proposer.carried_dtype.itemsize


def export_carried(proposer: SpecProposer, seq: Sequence, num_tokens: int) -> bytes:
    """Prefill side: the flag and the features of the carried positions (zeros where it lacks them)."""
    features = proposer.carried_features(seq.seq_id, *carried_span(proposer, num_tokens))
    if features is None:
        return bytes(carried_bytes(proposer, num_tokens))
    return np.int64(1).tobytes() + features.contiguous().cpu().view(torch.uint8).numpy().tobytes()


def import_carried(proposer: SpecProposer, blob: bytes, num_tokens: int) -> tuple[int, torch.Tensor] | None:
    """Decode side: the first carried position and the features from it, or None where the prefill
    engine had none to send."""
    if not np.frombuffer(blob[:FLAG_BYTES], dtype="<i8")[0]:
        return None
    start, end = carried_span(proposer, num_tokens)
    rows = torch.frombuffer(bytearray(blob[FLAG_BYTES:]), dtype=torch.uint8).view(proposer.carried_dtype)
    return start, rows.view(end - start, proposer.carried_row)


def window_flags(kvm: KVManager, num_tokens: int) -> list[bool]:
    """Per page holding ``num_tokens`` tokens: whether its windowed components move too (those
    within reach of the end, the ones the next step reads)."""
    count = -(-num_tokens // kvm.page_size)
    if kvm.window is None:
        return [False] * count
    first, _ = kvm.window.span(num_tokens, num_tokens, kvm.page_size)
    return [i >= first for i in range(count)]


def export_payload(kvm: KVManager, kv: KVCache, seq: Sequence, proposer: SpecProposer | None = None) -> KVPayload:
    """Prefill side, once the prompt is computed: its pages' bytes (and the ``proposer``'s carried
    features) and checksums."""
    prompt = seq.prompt_token_ids
    n = tokens_to_move(prompt)
    flags = window_flags(kvm, n)
    pages = [b.numpy().tobytes() for b in kv.read_pages(kvm.export_pages(seq)[:len(flags)], flags)]
    if proposer is not None:
        pages.append(export_carried(proposer, seq, n))
    return KVPayload(n, token_digest(prompt[:n]), layout_digest(kv, kvm.window_reach, proposer), pages,
                     [page_digest(p) for p in pages])


def expectation(kvm: KVManager, kv: KVCache, prompt_token_ids: list[int], first_page: int = 0,
                proposer: SpecProposer | None = None) -> KVExpectation:
    """Decode side: what the prefill engine must send for this prompt to an engine holding its
    first ``first_page`` pages (and drafting with ``proposer``)."""
    n = tokens_to_move(prompt_token_ids)
    sizes = [kv.page_size_bytes(w) for w in window_flags(kvm, n)[first_page:]]
    if proposer is not None:
        sizes.append(carried_bytes(proposer, n))
    return KVExpectation(n, token_digest(prompt_token_ids[:n]), layout_digest(kv, kvm.window_reach, proposer),
                         sizes, first_page)


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


def import_payload(kvm: KVManager, kv: KVCache, seq: Sequence, payload: KVPayload,
                   proposer: SpecProposer | None = None) -> tuple[int, torch.Tensor] | None:
    """Decode side: write a checked payload into the pages ``KVManager.import_pages`` gave ``seq``
    past those its prefix cache held; the ``proposer``'s carried features (``import_carried``)."""
    first, flags = payload.first_page, window_flags(kvm, payload.num_tokens)
    pages = payload.pages[:-1] if proposer is not None else payload.pages
    blobs = [torch.frombuffer(bytearray(p), dtype=torch.uint8) for p in pages]
    kv.write_pages(kvm.export_pages(seq)[first:len(flags)], flags[first:], blobs)
    return import_carried(proposer, payload.pages[-1], payload.num_tokens) if proposer is not None else None
