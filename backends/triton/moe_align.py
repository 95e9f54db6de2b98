"""Tokens sorted by expert, each expert's rows padded to the GEMM's BLOCK_M.

The grouped GEMM runs one program per BLOCK_M rows, and every row of a block must belong to one
expert, so that the block reads one expert's weights. Each expert's assignments (token t's k-th
choice is assignment ``t * top_k + k``) are listed together, in assignment order, and the list is
padded after each expert to a multiple of BLOCK_M with the index ``T * top_k``, which names no
assignment. Blocks of experts that receive nothing do not exist.

This is written with torch ops: a stable argsort (a radix sort on the GPU), a scatter, two cumsums
and a searchsorted, each a single launch that needs no host sync and can be captured in a graph;
the sizes are bounded by T * top_k, so the result has a shape known before the routing is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExpertBlocks:
    """``sorted_ids`` [blocks * block_m] int32: assignments grouped by expert, padded per expert
    with ``num_assignments``; ``block_expert`` [blocks] int32: the expert of each block of
    ``block_m`` rows, -1 past the rows in use; ``num_padded`` [1] int32: the rows in use."""

    sorted_ids: torch.Tensor
    block_expert: torch.Tensor
    num_padded: torch.Tensor
    block_m: int
    num_assignments: int

    @property
    def num_blocks(self) -> int:
        return self.block_expert.numel()


def max_padded_rows(num_assignments: int, num_experts: int, block_m: int) -> int:
    """At most min(assignments, experts) experts are used, each padding fewer than block_m rows;
    rounded up to whole blocks."""
    rows = num_assignments + min(num_assignments, num_experts) * (block_m - 1)
    return -(-rows // block_m) * block_m


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """Expert ids [T, top_k] -> the assignments sorted by expert in blocks of ``block_m`` rows."""
    flat = ids.reshape(-1).long()
    n = flat.numel()
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    order = flat.argsort(stable=True)
    expert_of_sorted = flat[order]
    rank_in_expert = torch.arange(n, device=device) - (counts.cumsum(0) - counts)[expert_of_sorted]
    dest = (padded_end - padded)[expert_of_sorted] + rank_in_expert
    rows = max_padded_rows(n, num_experts, block_m)
    sorted_ids = torch.full((rows,), n, dtype=torch.int32, device=device).scatter_(0, dest, order.int())
    block_start = torch.arange(0, rows, block_m, device=device)
    block_expert = torch.searchsorted(padded_end, block_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).int()
    return ExpertBlocks(sorted_ids, block_expert, padded_end[-1:].int(), block_m, n)
