"""DSpark's context rows kept by prefix (prefix_rows.py) as page records of the hierarchical cache
(core/kv/page_rows.py): a prompt whose prefix comes back from host memory or storage drafts as if
its rows had stayed on the device, as computing the prompt would.

The rows are a function of the tokens, the target and the drafter: the page's content key names
the first two, ``identity`` the drafter (its method, shape, element type and every tensor's bytes),
so rows another drafter computed, or another training of this one, are never read. Hashing the
tensors happens once, at start-up, where the hierarchical cache is on.
"""

from __future__ import annotations

import torch
import xxhash

from .prefix_rows import PrefixRows


def drafter_identity(method: str, drafter: torch.nn.Module, dtype: torch.dtype) -> str:
    """A digest of what a position's context rows are computed by: ``method``, the drafter's shape,
    the rows' element type and every tensor of the drafter's state."""
    h = xxhash.xxh3_128(f"{method} {drafter.shape.dumps()} {dtype}".encode())
    for name, tensor in drafter.state_dict().items():
        h.update(name.encode())
        h.update(tensor.detach().contiguous().cpu().view(torch.uint8).numpy())
    return h.hexdigest()


class TierRows:
    def __init__(self, prefixes: PrefixRows, row: torch.Size, dtype: torch.dtype, device: torch.device,
                 identity: str) -> None:
        """``row``: one position's rows [layers, 2, kv heads, head dim] of ``dtype``, on ``device``."""
        self.prefixes, self.dtype, self.device, self.identity = prefixes, dtype, device, identity
        self._page = (row[0], row[1], prefixes.page_size, *row[2:])  # a page's rows, as PrefixRows keeps them
        self.record_bytes = prefixes.page_size * row.numel() * dtype.itemsize

    def held(self, tokens: list[int], num_pages: int) -> int:
        return self.prefixes.held(tokens, num_pages)

    def records(self, tokens: list[int], first: int, count: int) -> torch.Tensor | None:
        pages = self.prefixes.pages(tokens, first, count)
        if not pages:
            return None
        return torch.stack(pages).view(torch.uint8).view(len(pages), self.record_bytes)

    def restore(self, tokens: list[int], first: int, records: list[torch.Tensor]) -> None:
        pages = [r.view(self.dtype).view(self._page).to(self.device) for r in records]
        self.prefixes.restore(tokens, first, pages)
