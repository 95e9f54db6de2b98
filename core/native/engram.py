"""DeepSeek's Engram (conditional n-gram memory, arXiv 2601.07372) in torch, as DeepSeek-V4.1 runs it:
the oracle of the hashing and of the gate.

A token's n-grams of order 2..N (itself and the N - 1 tokens before it, in compressed ids; pad
before the sequence's start) hash by multiplicative XOR, ``mix = (t0 m0) ^ (t1 m1) ^ ...``, one
running value per order, into a prime-sized bucket range per (order, head) of one concatenated
table. The rows found project to one value and a key per residual stream; each stream adds the
value, gated by how well its key matches the stream.
"""

from __future__ import annotations

import torch


def ngram_rows(ids: torch.Tensor, multipliers: torch.Tensor, primes: torch.Tensor,
               offsets: torch.Tensor) -> torch.Tensor:
    """ids [S, N] int64 (compressed ids of each token and the N - 1 before it, nearest first, pad
    before position 0), multipliers [N] int64 (odd), primes and offsets [N - 1, K] int64 (each
    (order, head)'s table size and first row) -> table rows [S, (N - 1) * K] int64, order-major."""
    mix = ids[:, 0] * multipliers[0]
    rows = []
    for k in range(1, ids.shape[1]):
        mix = torch.bitwise_xor(mix, ids[:, k] * multipliers[k])
        rows.append(torch.remainder(mix[:, None], primes[k - 1]) + offsets[k - 1])
    return torch.cat(rows, dim=1)


def engram_gate(streams: torch.Tensor, keys: torch.Tensor, value: torch.Tensor, q_weight: torch.Tensor,
                k_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """streams, keys [T, n, D], value [T, D], q_weight, k_weight [n, D] -> new streams [T, n, D] in the
    streams' dtype: stream + gate * value, in fp32, where gate = sigmoid(ssqrt(RMSNorm(stream) q_weight
    . RMSNorm(key) k_weight / sqrt(D))) and ssqrt(x) = sign(x) sqrt(max(|x|, 1e-6))."""
    h, k = streams.float(), keys.float()
    rstd = torch.rsqrt(h.square().mean(-1) + eps) * torch.rsqrt(k.square().mean(-1) + eps)
    dot = (h * (q_weight.float() * k_weight.float()) * k).sum(-1) * rstd * h.shape[-1] ** -0.5
    magnitude = dot.abs().clamp_min(1e-6).sqrt()
    gate = torch.sigmoid(torch.where(dot < 0, -magnitude, magnitude))
    return (h + gate.unsqueeze(-1) * value.float().unsqueeze(-2)).to(streams.dtype)
