"""The sampling family's oracle: filtering by sorting each row, the draw in torch ops."""

from __future__ import annotations

import torch

from ..families.sampling import SamplingBackend
from ..to_device import to_device


def filter_logits(logits: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float]) -> torch.Tensor:
    """Set to -inf every token that top-k, then top-p, then min-p leaves out, row by row.

    ``top_k`` 0 is off; top-p keeps the smallest set of most likely tokens whose probability
    reaches ``top_p``; min-p drops tokens less likely than ``min_p`` times the most likely one.
    """
    vocab = logits.shape[-1]
    dev = logits.device
    use_k = any(0 < k < vocab for k in top_k)
    use_p = any(p < 1 for p in top_p)
    if use_k or use_p:
        ordered, order = logits.sort(dim=-1, descending=True)
        if use_k:
            k = to_device([k if 0 < k < vocab else vocab for k in top_k], torch.int64, dev)
            ordered.masked_fill_(torch.arange(vocab, device=dev)[None, :] >= k[:, None], float("-inf"))
        if use_p:
            probs = ordered.softmax(dim=-1)
            before = probs.cumsum(dim=-1) - probs  # mass of the more likely tokens
            p = to_device([p if p < 1 else float("inf") for p in top_p], torch.float32, dev)
            ordered.masked_fill_(before >= p[:, None], float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, ordered)
    if any(m > 0 for m in min_p):
        probs = logits.softmax(dim=-1)
        floor = probs.amax(dim=-1, keepdim=True) * to_device(min_p, torch.float32, dev)[:, None]
        logits = logits.masked_fill(probs < floor, float("-inf"))
    return logits


class NativeSampling(SamplingBackend):
    name = "native"

    def draw(self, logits: torch.Tensor, noise: torch.Tensor, temperature: list[float], top_k: list[int],
             top_p: list[float], min_p: list[float]) -> torch.Tensor:
        x = logits / to_device(temperature, logits.dtype, logits.device)[:, None]
        probs = filter_logits(x, top_k, top_p, min_p).softmax(dim=-1)
        # noise 0 would turn an excluded token's 0/0 into NaN, which argmax prefers
        return (probs / noise.clamp_min(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)
