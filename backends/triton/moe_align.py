"""Tokens sorted by expert, each expert's rows padded to the GEMM's BLOCK_M.

The grouped GEMM runs one program per BLOCK_M rows, and every row of a block must belong to one
expert, so that the block reads one expert's weights. Each expert's assignments (token t's k-th
choice is assignment ``t * top_k + k``) are listed together, in assignment order, and the list is
padded after each expert to a multiple of BLOCK_M with the index ``T * top_k``, which names no
assignment. Blocks of experts that receive nothing do not exist.

Three small kernels instead of a sort: chunks of assignments count their experts; one program
scans the counts into each chunk's first row per expert (and each block's expert); the chunks
then place their assignments, an assignment's rank among the same expert's in its chunk coming
from a CHUNK x CHUNK comparison. Five launches in all with the two fills, where torch ops
(argsort, scatter, cumsums, searchsorted) take about twenty five, which a decode step pays for
even in a graph; no host sync, and sizes bounded by T * top_k, so the shapes are known before the
routing is. A decode step's assignments fit one chunk: then one program does all of it, and finds
each row's assignment (or the padding) rather than placing assignments, so nothing needs a fill.
The ids may be a column slice of a wider routing (DeepSeek-V4's routed experts apart from the
shared one): the kernels read them through their row stride, so a slice costs no copy. An id -1
names no expert (the padding rows of an expert-parallel exchange, core/distributed/moe.py): it is
counted for none and placed nowhere, so the blocks, and the grouped GEMMs over them, hold only the
assignments of real experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .pdl import launch_options, wait_for_prior
from .target import config_for


@dataclass(frozen=True)
class ExpertBlocks:
    """``sorted_ids`` [blocks * block_m] int32: assignments grouped by expert, padded per expert
    with ``num_assignments``; ``block_expert`` [blocks] int32: the expert of each block of
    ``block_m`` rows, -1 past the rows in use; ``num_padded`` [1] int32: the rows in use;
    ``counters``: int32 zeros for running both GEMMs in one launch (moe_one_launch: a flag per block,
    a ticket, then the combine's arrival counts), where the aligning launch zeroed them."""

    sorted_ids: torch.Tensor
    block_expert: torch.Tensor
    num_padded: torch.Tensor
    block_m: int
    num_assignments: int
    counters: torch.Tensor | None = None

    @property
    def num_blocks(self) -> int:
        return self.block_expert.numel()


@dataclass(frozen=True)
class AlignConfig:
    chunk: int  # assignments per counting / placing program
    scan_rows: int  # chunks per step of the scan
    scan_blocks: int  # blocks per step of the block -> expert pass
    num_warps: int


ALIGN = {
    "cuda": AlignConfig(chunk=64, scan_rows=16, scan_blocks=32, num_warps=4),
    "hip": AlignConfig(chunk=64, scan_rows=16, scan_blocks=32, num_warps=4),
    "default": AlignConfig(chunk=32, scan_rows=8, scan_blocks=16, num_warps=4),
}


@triton.jit
def _expert_of(ids_ptr, assignment, valid, top_k, stride_t):
    """The expert of assignment t * top_k + k: ids[t, k] of ids [T, top_k] with row stride stride_t; -1
    where not valid."""
    token = assignment // top_k
    return tl.load(ids_ptr + token * stride_t + (assignment - token * top_k), mask=valid, other=-1)


@triton.jit
def _count_kernel(ids_ptr, chunk_counts_ptr, n, top_k, stride_t, CHUNK: tl.constexpr, EXPERTS: tl.constexpr,
                  PDL: tl.constexpr):
    """chunk_counts[c, e]: how many of chunk c's assignments chose expert e."""
    wait_for_prior(PDL)
    chunk = tl.program_id(0)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    expert = _expert_of(ids_ptr, offs, offs < n, top_k, stride_t)
    experts = tl.arange(0, EXPERTS)
    counts = tl.sum((expert[:, None] == experts[None, :]).to(tl.int32), axis=0)
    tl.store(chunk_counts_ptr + chunk * EXPERTS + experts, counts)


@triton.jit
def _scan_kernel(chunk_counts_ptr, chunk_start_ptr, block_expert_ptr, num_padded_ptr,
                 num_chunks, num_experts, num_blocks, BLOCK_M: tl.constexpr, EXPERTS: tl.constexpr,
                 SCAN_ROWS: tl.constexpr, SCAN_BLOCKS: tl.constexpr, PDL: tl.constexpr):
    """chunk_start[c, e]: the row of chunk c's first assignment to expert e; block_expert;
    num_padded. One program: the counts are [chunks, experts], a few thousand entries."""
    wait_for_prior(PDL)
    experts = tl.arange(0, EXPERTS)
    totals = tl.zeros([EXPERTS], dtype=tl.int32)
    for c0 in range(0, num_chunks, SCAN_ROWS):
        rows = c0 + tl.arange(0, SCAN_ROWS)
        tile = tl.load(chunk_counts_ptr + rows[:, None] * EXPERTS + experts[None, :],
                       mask=rows[:, None] < num_chunks, other=0)
        totals += tl.sum(tile, axis=0)
    padded = (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, axis=0)
    running = padded_end - padded
    for c0 in range(0, num_chunks, SCAN_ROWS):
        rows = c0 + tl.arange(0, SCAN_ROWS)
        mask = rows[:, None] < num_chunks
        tile = tl.load(chunk_counts_ptr + rows[:, None] * EXPERTS + experts[None, :], mask=mask, other=0)
        tl.store(chunk_start_ptr + rows[:, None] * EXPERTS + experts[None, :],
                 running[None, :] + tl.cumsum(tile, axis=0) - tile, mask=mask)
        running += tl.sum(tile, axis=0)
    tl.store(num_padded_ptr, tl.sum(padded, axis=0))
    store_block_experts(padded_end, block_expert_ptr, num_experts, num_blocks, BLOCK_M, SCAN_BLOCKS)


@triton.jit
def store_block_experts(padded_end, block_expert_ptr, num_experts, num_blocks, BLOCK_M: tl.constexpr,
                         SCAN_BLOCKS: tl.constexpr):
    """A block's expert is the first whose padded rows end after the block starts; -1 past the last."""
    for b0 in range(0, num_blocks, SCAN_BLOCKS):
        blocks = b0 + tl.arange(0, SCAN_BLOCKS)
        expert = tl.sum((padded_end[None, :] <= blocks[:, None] * BLOCK_M).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + blocks, tl.where(expert < num_experts, expert, -1), mask=blocks < num_blocks)


@triton.jit
def _align_one_chunk_kernel(ids_ptr, sorted_ids_ptr, block_expert_ptr, num_padded_ptr, n, top_k, stride_t,
                            num_experts, num_blocks, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
                            EXPERTS: tl.constexpr, SCAN_BLOCKS: tl.constexpr, PDL: tl.constexpr):
    """All of the alignment for at most CHUNK assignments, in one program."""
    wait_for_prior(PDL)
    lane = tl.arange(0, CHUNK)
    valid = lane < n
    align_lanes(_expert_of(ids_ptr, lane, valid, top_k, stride_t), valid, lane, n, sorted_ids_ptr, block_expert_ptr,
                num_padded_ptr, num_experts, num_blocks, BLOCK_M, CHUNK, EXPERTS, SCAN_BLOCKS)


@triton.jit
def align_lanes(expert, valid, assignment, n, sorted_ids_ptr, block_expert_ptr, num_padded_ptr, num_experts,
                num_blocks, BLOCK_M: tl.constexpr, LANES: tl.constexpr, EXPERTS: tl.constexpr,
                SCAN_BLOCKS: tl.constexpr):
    """The alignment of n assignments held one a lane, in assignment order (lanes not ``valid`` hold
    none; ``expert`` -1 there): row r of expert e's padded rows holds e's assignment of rank
    r - start[e] if there is one, else the padding n. Nothing needs a fill."""
    lane = tl.arange(0, LANES)
    experts = tl.arange(0, EXPERTS)
    counts = tl.sum((expert[:, None] == experts[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, axis=0)
    start = padded_end - padded
    rank = tl.sum(((expert[:, None] == expert[None, :]) & (lane[None, :] < lane[:, None])).to(tl.int32), axis=1)
    tl.store(num_padded_ptr, tl.sum(padded, axis=0))
    for r0 in range(0, num_blocks * BLOCK_M, LANES):
        rows = r0 + lane
        row_expert = tl.sum((padded_end[None, :] <= rows[:, None]).to(tl.int32), axis=1)
        row_start = tl.sum(tl.where(experts[None, :] == row_expert[:, None], start[None, :], 0), axis=1)
        match = (expert[None, :] == row_expert[:, None]) & (rank[None, :] == (rows - row_start)[:, None]) \
            & valid[None, :]
        found = tl.max(tl.where(match, assignment[None, :], -1), axis=1)
        tl.store(sorted_ids_ptr + rows, tl.where(found >= 0, found, n), mask=rows < num_blocks * BLOCK_M)
    store_block_experts(padded_end, block_expert_ptr, num_experts, num_blocks, BLOCK_M, SCAN_BLOCKS)


@triton.jit
def _place_kernel(ids_ptr, chunk_start_ptr, sorted_ids_ptr, n, top_k, stride_t, CHUNK: tl.constexpr,
                  EXPERTS: tl.constexpr, PDL: tl.constexpr):
    """sorted_ids[row] = assignment, at its chunk's start for its expert plus its rank there (none for id -1)."""
    wait_for_prior(PDL)
    chunk = tl.program_id(0)
    lane = tl.arange(0, CHUNK)
    offs = chunk * CHUNK + lane
    expert = _expert_of(ids_ptr, offs, offs < n, top_k, stride_t)
    placed = expert >= 0  # not past n, nor an id -1 (no expert)
    earlier_same = (expert[:, None] == expert[None, :]) & (lane[None, :] < lane[:, None])
    rank = tl.sum(earlier_same.to(tl.int32), axis=1)
    start = tl.load(chunk_start_ptr + chunk * EXPERTS + tl.where(placed, expert, 0), mask=placed, other=0)
    tl.store(sorted_ids_ptr + start + rank, offs, mask=placed)


def max_padded_rows(num_assignments: int, num_experts: int, block_m: int) -> int:
    """At most min(assignments, experts) experts are used, each padding fewer than block_m rows;
    rounded up to whole blocks."""
    rows = num_assignments + min(num_assignments, num_experts) * (block_m - 1)
    return -(-rows // block_m) * block_m


def unfilled_blocks(num_assignments: int, num_experts: int, block_m: int, device: torch.device,
                    arrival_counts: int | None = None) -> ExpertBlocks:
    """The alignment's tensors as allocated, for a kernel that writes every entry (``align_lanes``);
    with ``arrival_counts``, counters for one launch of both GEMMs with that many arrival counts."""
    rows = max_padded_rows(num_assignments, num_experts, block_m)
    counters = None if arrival_counts is None else \
        torch.empty(rows // block_m + 1 + arrival_counts, dtype=torch.int32, device=device)
    return ExpertBlocks(torch.empty(rows, dtype=torch.int32, device=device),
                        torch.empty(rows // block_m, dtype=torch.int32, device=device),
                        torch.empty(1, dtype=torch.int32, device=device), block_m, num_assignments, counters)


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """Expert ids [T, top_k] (any row stride) -> the assignments sorted by expert in blocks of
    ``block_m`` rows."""
    if ids.dim() != 2:
        raise ValueError(f"expert ids {list(ids.shape)} are not [tokens, top_k]")
    ids = ids if ids.stride(1) == 1 else ids.contiguous()
    n, top_k, device = ids.numel(), ids.shape[1], ids.device
    layout = (top_k, ids.stride(0))
    rows = max_padded_rows(n, num_experts, block_m)
    cfg = config_for(ALIGN, device)
    experts = triton.next_power_of_2(num_experts)
    pdl = launch_options(device)
    if 0 < n <= cfg.chunk:
        blocks = unfilled_blocks(n, num_experts, block_m, device)
        _align_one_chunk_kernel[(1,)](ids, blocks.sorted_ids, blocks.block_expert, blocks.num_padded, n, *layout,
                                      num_experts, rows // block_m, BLOCK_M=block_m, CHUNK=cfg.chunk, EXPERTS=experts,
                                      SCAN_BLOCKS=cfg.scan_blocks, num_warps=cfg.num_warps, **pdl)
        return blocks
    sorted_ids = torch.full((rows,), n, dtype=torch.int32, device=device)
    block_expert = torch.empty(rows // block_m, dtype=torch.int32, device=device)
    num_padded = torch.zeros(1, dtype=torch.int32, device=device)
    blocks = ExpertBlocks(sorted_ids, block_expert, num_padded, block_m, n)
    if n == 0:
        return blocks
    chunks = triton.cdiv(n, cfg.chunk)
    chunk_counts = torch.empty(chunks, experts, dtype=torch.int32, device=device)
    chunk_start = torch.empty_like(chunk_counts)
    _count_kernel[(chunks,)](ids, chunk_counts, n, *layout, CHUNK=cfg.chunk, EXPERTS=experts,
                             num_warps=cfg.num_warps, **pdl)
    _scan_kernel[(1,)](chunk_counts, chunk_start, block_expert, num_padded, chunks, num_experts, rows // block_m,
                       BLOCK_M=block_m, EXPERTS=experts, SCAN_ROWS=cfg.scan_rows, SCAN_BLOCKS=cfg.scan_blocks,
                       num_warps=cfg.num_warps, **pdl)
    _place_kernel[(chunks,)](ids, chunk_start, sorted_ids, n, *layout, CHUNK=cfg.chunk, EXPERTS=experts,
                             num_warps=cfg.num_warps, **pdl)
    return blocks
