"""Every sequence's page table on the host, one row each, changed only where its pages change.

A step's batch gathers its sequences' rows in one numpy call (core/runner.py) instead of packing
every sequence's page list again: a decode changes its row once in ``page_size`` tokens. The KV
manager (manager.py) writes a row whenever it changes that sequence's pages, and nothing else
writes them. Row 0 is all zeros (the null page), for padding; past a sequence's pages its row is
zeros too.
"""

from __future__ import annotations

import numpy as np


class PageTable:
    def __init__(self, width: int, num_rows: int = 64) -> None:
        """``width``: the most pages one sequence may hold."""
        self.array = np.zeros((max(num_rows, 2), width), dtype=np.int32)
        self._free = list(range(self.array.shape[0] - 1, 0, -1))

    @property
    def width(self) -> int:
        return self.array.shape[1]

    def assign(self, pages: list[int]) -> int:
        """A row for a sequence holding ``pages``; the table doubles when none is free."""
        if not self._free:
            n = self.array.shape[0]
            self.array = np.concatenate([self.array, np.zeros_like(self.array)])
            self._free = list(range(2 * n - 1, n - 1, -1))
        row = self._free.pop()
        self.write(row, 0, pages)
        return row

    def write(self, row: int, start: int, pages: list[int]) -> None:
        """``pages`` at columns ``start``.. of ``row``."""
        end = start + len(pages)
        if end > self.width:
            raise ValueError(f"a sequence would hold {end} pages; a page table holds at most {self.width}")
        self.array[row, start:end] = pages

    def clear(self, row: int, start: int, end: int) -> None:
        """Columns ``start``..``end`` of ``row`` hold no page any more."""
        self.array[row, start:end] = 0

    def release(self, row: int, num_pages: int) -> None:
        """The row's sequence holds nothing now (it held ``num_pages``)."""
        self.array[row, :num_pages] = 0
        self._free.append(row)

    def gather(self, rows: list[int], width: int) -> np.ndarray:
        """The first ``width`` columns of ``rows``, in order: a batch's page table ([len(rows), width] int32)."""
        return self.array.take(rows, 0)[:, :width]
