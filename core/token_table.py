"""The token table: every running sequence's latest token, kept on the device at the sequence's slot.

A step is launched before the host has read the tokens of the step before it ("schedule N+1,
launch N+1, process N"), so a decode's input token may so far exist on the device only. The
sampler writes each draw into its sequence's slot; the next step reads the input ids the host
lacks from there, and the sampler reads a row's token still in flight there for its penalties.
Reads and writes are queued on the device in step order, so a slot handed to another sequence
is written by its new owner's first draw before anything reads it.

The scheduler hands out slots: a sequence holds one while it runs. Slot 0 is scratch: the draw of
a sequence that holds none (an n > 1 sibling left waiting for pages) lands there, never read.
"""

from __future__ import annotations

import torch

from .to_device import to_device


class TokenTable:
    def __init__(self, num_slots: int, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.tokens = torch.zeros(num_slots + 1, dtype=torch.int64, device=self.device)
        self._free = list(range(num_slots, 0, -1))
        self._last: tuple[list[int], torch.Tensor] = ([], torch.zeros(0, dtype=torch.int64, device=self.device))

    @property
    def num_slots(self) -> int:
        return self.tokens.shape[0] - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    def assign(self) -> int:
        """A free slot. The table doubles when none is left (n > 1 siblings run beside max_num_seqs);
        the new tensor is copied from the old one on the device, in order with the steps around it."""
        if not self._free:
            n = self.tokens.shape[0]
            self.tokens = torch.cat([self.tokens, torch.zeros_like(self.tokens)])
            self._free = list(range(2 * n - 1, n - 1, -1))
        return self._free.pop()

    def release(self, slot: int) -> None:
        if slot:
            self._free.append(slot)

    def index(self, slots: list[int]) -> torch.Tensor:
        """``slots`` on the device. The last list's tensor is kept: a decode step's runner and its
        sampler name the same slots, so a step sends them once."""
        if slots != self._last[0]:
            self._last = (list(slots), to_device(slots, torch.int64, self.device))
        return self._last[1]

    def read(self, slots: list[int]) -> torch.Tensor:
        return self.tokens.index_select(0, self.index(slots))

    def write(self, slots: list[int], tokens: torch.Tensor) -> None:
        self.tokens.index_copy_(0, self.index(slots), tokens.to(torch.int64))

    def fill(self, input_ids: torch.Tensor, rows: list[int], slots: list[int]) -> None:
        """Write the tokens of ``slots`` into the packed ``input_ids`` at ``rows`` (ascending): a
        step's inputs that the host has not seen yet."""
        if rows[-1] == len(rows) - 1:  # the first rows, as in a decode step: read straight into them
            torch.index_select(self.tokens, 0, self.index(slots), out=input_ids[:len(rows)])
        else:
            input_ids.index_copy_(0, to_device(rows, torch.int64, self.device), self.read(slots))
