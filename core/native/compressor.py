"""DeepSeek-V4's KV compressors: softmax-gated pooling of each window of ``rate`` tokens into one entry.

HCA pools disjoint windows. CSA overlaps them: each token projects two series, Ca (first half of
the channels) and Cb (second half), and entry w pools window w-1's Ca with window w's Cb, so it
sees 2 * rate tokens. The gate softmax runs per channel over the pooled slots, in fp32.
DeepSeek-V4.1's CSA2 pools disjoint windows with no position bias: at rate 2 each pair by a
softmax over its two gate scores; at rate 1 a token's projection is its entry (no gate).
"""

from __future__ import annotations

import torch


def pool_windows(kv: torch.Tensor, gate: torch.Tensor, position_bias: torch.Tensor | None, rate: int,
                 overlap: bool) -> torch.Tensor:
    """kv, gate [S, W] of one sequence from position 0 -> pooled entries [S // rate, W or W / 2].

    ``position_bias`` [rate, W] (None: none) is added to the gate by slot within the window.
    Tokens past the last complete window make no entry. Window 0 of an overlapping compressor has
    no predecessor: its Ca slots weigh nothing.
    """
    n = kv.shape[0] // rate
    kv = kv[: n * rate].view(n, rate, kv.shape[-1])
    gate = gate[: n * rate].view(n, rate, gate.shape[-1])
    if position_bias is not None:
        gate = gate + position_bias
    if overlap:
        d = kv.shape[-1] // 2
        prev_kv = kv.new_zeros(n, rate, d)
        prev_gate = gate.new_full((n, rate, d), float("-inf"))
        prev_kv[1:], prev_gate[1:] = kv[:-1, :, :d], gate[:-1, :, :d]
        kv = torch.cat([prev_kv, kv[..., d:]], dim=1)
        gate = torch.cat([prev_gate, gate[..., d:]], dim=1)
    return (kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1)


def visible_entries(positions: torch.Tensor, rate: int) -> torch.Tensor:
    """[S] query positions -> how many entries each may see: entry w covers tokens up to
    (w + 1) * rate - 1, and a query sees it only from the position after the window closes."""
    return (positions + 1) // rate


def entry_positions(num_entries: int, rate: int, device=None) -> torch.Tensor:
    """The position each entry is rotated at: the first token of its window."""
    return torch.arange(num_entries, device=device) * rate
