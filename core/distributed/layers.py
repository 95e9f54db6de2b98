"""Tensor-parallel layers: a weight split over the ranks of a group, and the collective that puts
the product back together.

A column-parallel linear splits its output rows (each rank computes its slice of y, no
communication); a row-parallel linear splits its input columns (each rank a partial sum of y, one
all-reduce). Attention's q/k/v and the MLP's gate/up are column-parallel, their output projections
row-parallel, so a layer costs two all-reduces. The embedding and the LM head split the vocabulary.
A weight records which part of its checkpoint tensor it holds in ``partition`` (dim, index,
count): the loader reads only that part (core/models/weights.py).

With a group of one process these are the plain layers: same weights, same calls, no collective.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ..families.linear import LinearBackend, LinearWeight
from ..models.layers import Linear, empty_param
from .group import ParallelGroup

Part = tuple[int, int, int]  # (dim, index, count): chunk ``index`` of ``count`` equal chunks along ``dim``


def split(total: int, count: int, what: str) -> int:
    if total % count:
        raise ValueError(f"{what}: {total} does not split over {count} ranks")
    return total // count


def head_chunks(heads: int, group: ParallelGroup, what: str) -> int:
    """Into how many chunks ``heads`` split over the group: one per rank, or where there are fewer
    heads than ranks one per head, each held by ``size / heads`` ranks (KV heads replicated)."""
    if heads % group.size == 0:
        return group.size
    if group.size % heads == 0:
        return heads
    raise ValueError(f"{what}: {heads} heads neither split over {group.size} ranks nor replicate evenly across them")


class ColumnParallelLinear(Linear):
    """y[..., rank's rows] = x @ W[rank's rows].T. ``outputs``: the output rows, or the stacked
    checkpoint tensors of a fused projection as name -> (rows, chunks): each is cut into ``chunks``
    (``group.size``, or fewer for replicated KV heads) and this rank holds chunk
    ``rank * chunks // size``; ``shards`` then maps each name to its local rows, ``parts`` to its part."""

    def __init__(self, in_features: int, outputs: int | dict[str, tuple[int, int]], backend: LinearBackend,
                 group: ParallelGroup, *, bias: bool = False, dtype: torch.dtype, device: torch.device | str) -> None:
        stacked = isinstance(outputs, dict)
        named = outputs if stacked else {"": (outputs, group.size)}
        shards, parts, offset = {}, {}, 0
        for name, (rows, chunks) in named.items():
            local = split(rows, chunks, f"output rows of {name or 'a linear'}")
            shards[name] = (offset, local)
            parts[name] = (0, group.rank * chunks // group.size, chunks)
            offset += local
        super().__init__(in_features, offset, backend, bias=bias, dtype=dtype, device=device,
                         shards=shards if stacked else None)
        self.parts: dict[str, Part] = parts if stacked else {}
        if not stacked:
            for p in (self.weight, self.bias):
                if p is not None:
                    p.partition = parts[""]


class RowParallelLinear(Linear):
    """y = all_reduce(x[..., rank's columns] @ W[:, rank's columns].T) (+ b once, after the sum)."""

    def __init__(self, in_features: int, out_features: int, backend: LinearBackend, group: ParallelGroup, *,
                 bias: bool = False, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__(split(in_features, group.size, "input columns of a row-parallel linear"), out_features,
                         backend, bias=bias, dtype=dtype, device=device)
        self.group = group
        self.weight.partition = (1, group.rank, group.size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(self.backend.apply(x, self.local_weight))

    @property
    def local_weight(self) -> LinearWeight:
        """This rank's columns of the weight, without the bias (added once, after the sum)."""
        return LinearWeight(self.weight, self.scheme, self.weight_scale)

    def reduce(self, y: torch.Tensor) -> torch.Tensor:
        """The output from this rank's product with ``local_weight``: the ranks' sum, plus the bias."""
        y = self.group.all_reduce(y)
        return y if self.bias is None else y + self.bias.to(y.dtype)


class VocabParallelEmbedding(nn.Module):
    """Each rank holds a contiguous slice of the vocabulary's rows; a token's row comes from the
    rank that holds it, zeros from the others, summed."""

    def __init__(self, vocab: int, hidden: int, group: ParallelGroup, *, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        rows = split(vocab, group.size, "the vocabulary")
        self.weight = empty_param(rows, hidden, dtype=dtype, device=device)
        self.weight.partition = (0, group.rank, group.size)
        self.group = group
        self.start = group.rank * rows

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.group.size == 1:
            return nn.functional.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        return self.group.all_reduce(x.masked_fill_(outside.unsqueeze(-1), 0))

    def whole(self) -> nn.Embedding:
        """The whole vocabulary's embedding, for a caller that runs on one rank alone: every rank of
        the group calls it (it gathers their rows)."""
        return nn.Embedding.from_pretrained(self.group.all_gather(self.weight.detach(), dim=0), freeze=True)


class ParallelLMHead(ColumnParallelLinear):
    """Logits of the rank's vocabulary slice in fp32 (the linear backend's ``logits``), gathered:
    every rank ends with all of them."""

    def __init__(self, hidden: int, vocab: int, backend: LinearBackend, group: ParallelGroup, *,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__(hidden, vocab, backend, group, dtype=dtype, device=device)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_gather(self.backend.logits(x, self.linear_weight), dim=-1)

    def whole(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The whole vocabulary's logits, for a caller that runs on one rank alone: every rank of the
        group calls it (it gathers their rows, and their scales where the weight has them)."""
        w = self.linear_weight
        scale = None if w.scale is None else self.group.all_gather(w.scale, dim=0)
        weight = LinearWeight(self.group.all_gather(w.data, dim=0), w.scheme, scale)
        return lambda x: self.backend.logits(x, weight)
