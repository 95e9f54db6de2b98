"""Rows a proposer keeps per page of a token prefix beside the target's KV (DSpark's context rows,
core/spec/dspark/tier_rows.py), which cross the cache tiers with the target's pages.

The hierarchy (hierarchy.py) writes a page's rows as a record of kind ``"rows"`` under the page's
content key and the rows' ``identity`` (what computed them: a drafter and its weights), checksummed
as every record is, when it writes the page (from a copy taken when the prefix cache stored the
page, where the write policy writes it later); it discards them with the page; a hit loaded from
below (or found on the device while the proposer let its rows go) gives the proposer back the rows
the lower tier holds. Rows are a function of the tokens and the drafter only, so a page's record is
the same with or without them: an engine without a proposer, or with another drafter, shares the
target's pages and finds no rows (a miss for rows only).
"""

from __future__ import annotations

from typing import Protocol

import torch

KIND = "rows"


def rows_key(page_key: str, identity: str) -> str:
    """The key of the rows record of the page under ``page_key``, computed by ``identity``."""
    return f"{page_key}:{KIND}-{identity}"


class PageRows(Protocol):
    identity: str  # names what computes the rows (a hex digest): rows of another are never read
    record_bytes: int  # one page's rows as bytes

    def held(self, tokens: list[int], num_pages: int) -> int:
        """How many of the first ``num_pages`` whole pages of ``tokens`` it keeps rows of, from the first."""

    def records(self, tokens: list[int], first: int, count: int) -> torch.Tensor | None:
        """[n, record_bytes] uint8 (where it keeps them: the device) of the rows of pages ``first``..
        (at most ``count``) of ``tokens``, up to the first it does not keep; None for none."""

    def restore(self, tokens: list[int], first: int, records: list[torch.Tensor]) -> None:
        """Keep ``records`` (``records``' rows, on the host) as the rows of pages ``first``.. of ``tokens``."""
