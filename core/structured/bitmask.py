"""Grammar masks on the logits: the tokens a row's grammar allows next, everything else -inf.

Each constrained row's matcher (xgrammar's ``GrammarMatcher``) writes its allowed tokens as a
bitmask on the host, 32 tokens an int32 word, bit ``j`` of word ``i`` for token ``32 i + j``; the
masks of the step's constrained rows go to the device in one copy (behind the queued work, through
pinned memory) and are unpacked there, so unconstrained rows in the same batch cost nothing and
nothing waits for the device. Torch alone: the same code on every backend.
"""

from __future__ import annotations

from typing import Any

import torch

from ..to_device import to_device


def allow_all(rows: int, vocab_size: int, device: torch.device) -> torch.Tensor:
    """[rows, ceil(vocab_size / 32)] int32 on the host, every token allowed, for matchers to fill
    (pinned where it goes to a CUDA device)."""
    return torch.full((rows, -(-vocab_size // 32)), -1, dtype=torch.int32, pin_memory=device.type == "cuda")


def unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, words] int32 -> [rows, vocab_size] bool, True where allowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[:, :, None] >> shifts) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_bitmask(logits: torch.Tensor, rows: list[int], host: torch.Tensor) -> torch.Tensor:
    """``logits`` with every token that ``host[i]`` forbids at -inf in row ``rows[i]`` (a new tensor:
    the logits may be a graph's output buffer)."""
    dev = logits.device
    allowed = unpack(host.to(dev, non_blocking=True), logits.shape[1])
    if len(rows) == logits.shape[0]:  # every row constrained, in order
        return logits.masked_fill(~allowed, float("-inf"))
    idx = to_device(rows, torch.int64, dev)
    return logits.index_copy(0, idx, logits.index_select(0, idx).masked_fill(~allowed, float("-inf")))


def mask_logits(logits: torch.Tensor, rows: list[int], matchers: list[Any]) -> torch.Tensor:
    """``logits`` with every token the matcher of row ``rows[i]`` forbids at -inf."""
    host = allow_all(len(matchers), logits.shape[1], logits.device)
    for i, m in enumerate(matchers):
        m.fill_next_token_bitmask(host, i)
    return apply_bitmask(logits, rows, host)
