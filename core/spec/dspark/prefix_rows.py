"""DSpark's context rows kept by token prefix, so a prefix hit drafts as computing the prompt would.

A position's context rows (its keys and values in every drafter layer) are a function of the
target's features there, which depend on the tokens up to it alone: like the target's KV, they can
be kept for a prefix and reused by any sequence that starts with it. Without them a sequence whose
prompt hits the target's prefix cache drafts from the positions after the hit only, and a
prefill/decode disaggregation prefill engine has no rows of the hit part to send. Recomputing them
would mean computing the target over the hit again, which the hit was to save; rows are far
smaller than that (a trained drafter's 512 elements a position).

Whole pages are kept (the engine's page size), each under a digest of every token up to its end,
least recently used dropped first, at most as many positions as the running sequences' contexts can
hold (``max_num_seqs`` of ``max_model_len``): at most what the live contexts take again. A
sequence's pages are kept once every position of the page is final (its token will not change: a
prompt's, or a kept token's, not a draft's).

Under the hierarchical cache the pages' rows also go below the device with the target's pages
(tier_rows.py): ``held`` and ``pages`` read them by token prefix, ``restore`` takes them back.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np
import torch


def _digest(before: bytes, tokens: list[int]) -> bytes:
    return hashlib.blake2b(before + np.asarray(tokens, dtype=np.int64).tobytes(), digest_size=16).digest()


def _chain(tokens: list[int], page_size: int, num_pages: int) -> list[bytes]:
    """The digests of the first ``num_pages`` whole pages of ``tokens``."""
    chain: list[bytes] = []
    for i in range(min(num_pages, len(tokens) // page_size)):
        chain.append(_digest(chain[-1] if chain else b"", tokens[i * page_size:(i + 1) * page_size]))
    return chain


class PrefixRows:
    def __init__(self, page_size: int, capacity_pages: int) -> None:
        self.page_size, self.capacity = page_size, capacity_pages
        self._pages: OrderedDict[bytes, torch.Tensor] = OrderedDict()  # digest -> rows [layers, 2, page, ...]
        self._chains: dict[int, list[bytes]] = {}  # seq id -> the digests of its first pages

    def keep(self, seq_id: int, token_ids: list[int], end: int, start: int, rows: torch.Tensor) -> None:
        """Positions before ``end`` of the sequence are final, and ``rows`` [layers, 2, >= end -
        start, ...] are those of positions ``start``..: keep every whole page among them not kept yet."""
        if self.capacity == 0:
            return
        chain, ps = self._chains.setdefault(seq_id, []), self.page_size
        while (len(chain) + 1) * ps <= end:
            i = len(chain)
            chain.append(_digest(chain[-1] if chain else b"", token_ids[i * ps:(i + 1) * ps]))
            if chain[-1] in self._pages:
                self._pages.move_to_end(chain[-1])
            elif i * ps >= start:
                self._put(chain[-1], rows[:, :, i * ps - start:(i + 1) * ps - start].clone())

    def _put(self, digest: bytes, rows: torch.Tensor) -> None:
        if self.capacity == 0:
            return
        self._pages[digest] = rows
        self._pages.move_to_end(digest)
        if len(self._pages) > self.capacity:
            self._pages.popitem(last=False)

    def held(self, token_ids: list[int], num_pages: int) -> int:
        """How many of the first ``num_pages`` whole pages of ``token_ids`` are kept, from the first."""
        return next((i for i, d in enumerate(_chain(token_ids, self.page_size, num_pages)) if d not in self._pages),
                    num_pages)

    def pages(self, token_ids: list[int], first: int, count: int) -> list[torch.Tensor]:
        """The rows of pages ``first``.. (at most ``count``) of ``token_ids`` kept, up to the first not kept."""
        out = []
        for d in _chain(token_ids, self.page_size, first + count)[first:]:
            if d not in self._pages:
                break
            out.append(self._pages[d])
        return out

    def restore(self, token_ids: list[int], first: int, pages: list[torch.Tensor]) -> None:
        """Keep ``pages`` (rows [layers, 2, page, ...] each) as those of pages ``first``.. of ``token_ids``."""
        chain = _chain(token_ids, self.page_size, first + len(pages))
        for digest, rows in zip(chain[first:], pages):
            self._put(digest, rows)

    def lookup(self, seq_id: int, token_ids: list[int]) -> torch.Tensor | None:
        """The rows of the longest run of whole pages of ``token_ids`` kept, from its start, before
        its last token (whose features the target computes), and the sequence's chain set to them."""
        chain, pages, ps = [], [], self.page_size
        while (len(chain) + 1) * ps < len(token_ids):
            i = len(chain)
            digest = _digest(chain[-1] if chain else b"", token_ids[i * ps:(i + 1) * ps])
            if digest not in self._pages:
                break
            self._pages.move_to_end(digest)
            chain.append(digest)
            pages.append(self._pages[digest])
        self._chains[seq_id] = chain
        return torch.cat(pages, 2) if pages else None

    def forget(self, seq_id: int) -> None:
        self._chains.pop(seq_id, None)

    def clear(self) -> None:
        self._pages.clear()
