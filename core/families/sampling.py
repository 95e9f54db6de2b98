"""Sampling family: temperature, top-k, top-p and min-p over a batch of logits, then the draw.

The sampler (core/sampler.py) owns what is per request and on the host (penalties, bias, seeds and
their noise, logprobs); a backend owns the one part that reads the whole vocabulary several times
per row, where a sort over a 152K vocabulary costs a small model's decode step a fifth of its time.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch


class SamplingBackend(ABC):
    name: str = "?"

    def __init__(self, ctx: Any) -> None:  # ctx: registry.SelectionContext
        self.ctx = ctx

    @abstractmethod
    def draw(self, logits: torch.Tensor, noise: torch.Tensor, temperature: list[float], top_k: list[int],
             top_p: list[float], min_p: list[float]) -> torch.Tensor:
        """One token per row of fp32 ``logits`` [B, V]: divide by the row's temperature, keep its top-k
        (0: all), then the most likely of those whose probability reaches top_p, then those at least
        min_p times as likely as the most likely; return argmax(probs / noise) over the kept tokens.
        ``noise`` [B, V] is Exp(1), so the draw picks a token with its probability."""

    def warm_up(self, vocab_size: int, max_rows: int, device: torch.device) -> None:
        """Compile, before a request waits for it, whatever ``draw`` can meet on up to ``max_rows``
        rows of ``vocab_size`` logits on ``device``; a backend of torch ops compiles nothing."""
