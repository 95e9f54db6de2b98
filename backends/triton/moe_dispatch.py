"""A decode step's MoE dispatch on one GPU in one launch: the routing and the alignment by expert.

What ``moe_routing.route`` and then ``moe_align.align_by_expert`` compute, to the bit, in one
program, in two passes over blocks of BLOCK_T tokens. The first routes each block
(``route_rows``), stores its weights and ids for the combine, and counts its assignments per
expert (token t's slot k is lane t * K_POW2 + k of the block, the slots past the route's width
idle), so the padded layout is known: each expert's first row, the blocks' experts, and the
padding rows, stored. The second routes each block again (from the logits: cheaper than a round
trip through memory a program would have to order) and places each assignment at its expert's
first row plus the assignments of that expert before it (earlier blocks' counts, then its rank in
the block). Every entry is written exactly once and nothing the program wrote is read back, so
no barrier is needed and nothing depends on how a target orders a program's stores. It also zeroes
the counters of the experts' one launch that follows (moe_one_launch.py), so that launch needs no
fill and a graph replays both as captured.

One program routes every token, so this is for decode: ``fits_one_program`` says when (at most
``DISPATCH``); a prefill's tokens route and align in their own launches. Grouped top-k stays
native, as in ``TritonMoE.route``.

The seam for expert-parallel dispatch is the routing this kernel stores: a dispatcher across GPUs
takes (weights, ids) as ``route`` gives them and aligns what it receives (``align_by_expert``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.core.families.moe import RoutingConfig

from .moe_align import ALIGN, ExpertBlocks, store_block_experts, unfilled_blocks
from .moe_routing import ROUTE_TILE, route_rows, route_width, routing_arguments, store_routes
from .pdl import launch_options, wait_for_prior
from .target import arch_of, pick

@dataclass(frozen=True)
class DispatchConfig:
    tokens: int  # the most tokens one program routes and aligns (a decode batch)
    lanes: int  # assignments a pass holds (rank: lanes x lanes comparisons)
    one_hot: int  # lanes x stack experts a pass compares at once


# the sm_90 build spills past 32 lanes against 512 experts or 64 against 256 (the AOT test reads its
# SASS); the token limit is not yet timed against the separate launches on a GPU. gfx942/gfx950: a
# 64-wide wave holds 64 lanes and a lane's 512 VGPRs their comparisons (V4-Flash: 212, no scratch, in
# the AOT test), so a pass takes 8 tokens of top-6 + shared, not 4: half the one program's serial
# passes over a 64-token decode step. hip (other AMD archs): cuda's, unchecked
CDNA_DISPATCH = DispatchConfig(64, 64, 64 * 512)
DISPATCH = {"cuda": DispatchConfig(64, 32, 32 * 512), "gfx942": CDNA_DISPATCH, "gfx950": CDNA_DISPATCH,
            "hip": DispatchConfig(64, 32, 32 * 512), "default": DispatchConfig(16, 32, 32 * 128)}


@triton.jit
def _block_lanes(logits_ptr, bias_ptr, table_ptr, token_ids_ptr, E, stride_l, scaling, weights_ptr, ids_ptr, t0, T,
                 SCORING: tl.constexpr, HAS_BIAS: tl.constexpr, HASHED: tl.constexpr, RENORMALIZE: tl.constexpr,
                 TOP_K: tl.constexpr, K_POW2: tl.constexpr, EXPERTS: tl.constexpr, ROUND_TO: tl.constexpr,
                 SHARED: tl.constexpr, BLOCK_T: tl.constexpr, STORE: tl.constexpr, ALIGNED: tl.constexpr):
    """Tokens t0 .. t0 + BLOCK_T - 1 routed -> (expert [LANES], valid [LANES], assignment [LANES]), one
    (token, slot) a lane in assignment order, the first ALIGNED slots of each token; with STORE their
    weights and ids stored too."""
    WIDTH: tl.constexpr = TOP_K + (SHARED >= 0)
    LANES: tl.constexpr = BLOCK_T * K_POW2
    rows = t0 + tl.arange(0, BLOCK_T)
    live = rows < T
    chosen, picked = route_rows(logits_ptr, bias_ptr, table_ptr, token_ids_ptr, rows, live, E, stride_l, scaling,
                                SCORING, HAS_BIAS, HASHED, RENORMALIZE, TOP_K, K_POW2, EXPERTS, BLOCK_T, ROUND_TO,
                                SHARED)
    if STORE:
        store_routes(weights_ptr, ids_ptr, rows, live, chosen, picked, WIDTH, K_POW2)
    lane = tl.arange(0, LANES)
    token, slot = t0 + lane // K_POW2, lane % K_POW2
    valid = (token < T) & (slot < ALIGNED)
    return tl.where(valid, tl.reshape(chosen, (LANES,)), -1), valid, token * ALIGNED + slot


@triton.jit
def _route_align_kernel(logits_ptr, bias_ptr, table_ptr, token_ids_ptr, E, stride_l, scaling,
                        weights_ptr, ids_ptr, sorted_ids_ptr, block_expert_ptr, num_padded_ptr, T, num_experts,
                        num_blocks, shared_sorted_ids_ptr, shared_block_expert_ptr, shared_num_padded_ptr,
                        shared_num_blocks, counters_ptr, num_counters, shared_counters_ptr, num_shared_counters,
                        SCORING: tl.constexpr, HAS_BIAS: tl.constexpr, HASHED: tl.constexpr,
                        RENORMALIZE: tl.constexpr, TOP_K: tl.constexpr, K_POW2: tl.constexpr,
                        EXPERTS: tl.constexpr, ROUND_TO: tl.constexpr, SHARED: tl.constexpr, BLOCK_T: tl.constexpr,
                        BLOCK_M: tl.constexpr, STACK_EXPERTS: tl.constexpr, SCAN_BLOCKS: tl.constexpr,
                        SHARED_APART: tl.constexpr, SHARED_BLOCK_M: tl.constexpr, PDL: tl.constexpr):
    """``route_align`` in a program of its own."""
    wait_for_prior(PDL)
    route_align(logits_ptr, bias_ptr, table_ptr, token_ids_ptr, E, stride_l, scaling, weights_ptr, ids_ptr,
                sorted_ids_ptr, block_expert_ptr, num_padded_ptr, T, num_experts, num_blocks, shared_sorted_ids_ptr,
                shared_block_expert_ptr, shared_num_padded_ptr, shared_num_blocks, counters_ptr, num_counters,
                shared_counters_ptr, num_shared_counters, SCORING, HAS_BIAS, HASHED, RENORMALIZE, TOP_K, K_POW2,
                EXPERTS, ROUND_TO, SHARED, BLOCK_T, BLOCK_M, STACK_EXPERTS, SCAN_BLOCKS, SHARED_APART,
                SHARED_BLOCK_M)


@triton.jit
def route_align(logits_ptr, bias_ptr, table_ptr, token_ids_ptr, E, stride_l, scaling,
                weights_ptr, ids_ptr, sorted_ids_ptr, block_expert_ptr, num_padded_ptr, T, num_experts,
                num_blocks, shared_sorted_ids_ptr, shared_block_expert_ptr, shared_num_padded_ptr,
                shared_num_blocks, counters_ptr, num_counters, shared_counters_ptr, num_shared_counters,
                SCORING: tl.constexpr, HAS_BIAS: tl.constexpr, HASHED: tl.constexpr,
                RENORMALIZE: tl.constexpr, TOP_K: tl.constexpr, K_POW2: tl.constexpr,
                EXPERTS: tl.constexpr, ROUND_TO: tl.constexpr, SHARED: tl.constexpr, BLOCK_T: tl.constexpr,
                BLOCK_M: tl.constexpr, STACK_EXPERTS: tl.constexpr, SCAN_BLOCKS: tl.constexpr,
                SHARED_APART: tl.constexpr, SHARED_BLOCK_M: tl.constexpr):
    """weights and ids [T, WIDTH] as ``_route_kernel`` stores them, and their alignment over a stack of
    ``num_experts`` (STACK_EXPERTS its power of two; a folded shared expert is the stack's last) as
    ``align_by_expert`` stores it, by one program. SHARED_APART: the shared expert has a stack of its
    own; the routed columns are aligned alone, and the shared column's alignment (every token in
    order, one expert) is written to the shared_* tensors in blocks of SHARED_BLOCK_M rows. counters
    and shared_counters: zeroed for the experts' one launch (moe_one_launch), num_counters and
    num_shared_counters words."""
    ALIGNED: tl.constexpr = TOP_K if SHARED_APART else TOP_K + (SHARED >= 0)
    LANES: tl.constexpr = BLOCK_T * K_POW2
    lane = tl.arange(0, LANES)
    experts = tl.arange(0, STACK_EXPERTS)
    counts = tl.zeros([STACK_EXPERTS], dtype=tl.int32)
    for t0 in range(0, T, BLOCK_T):
        expert, valid, assignment = _block_lanes(
            logits_ptr, bias_ptr, table_ptr, token_ids_ptr, E, stride_l, scaling, weights_ptr, ids_ptr, t0, T,
            SCORING, HAS_BIAS, HASHED, RENORMALIZE, TOP_K, K_POW2, EXPERTS, ROUND_TO, SHARED, BLOCK_T, True, ALIGNED)
        counts += tl.sum((expert[:, None] == experts[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, axis=0)
    start = padded_end - padded
    tl.store(num_padded_ptr, tl.sum(padded, axis=0))
    store_block_experts(padded_end, block_expert_ptr, num_experts, num_blocks, BLOCK_M, SCAN_BLOCKS)
    n = T * ALIGNED
    for r0 in range(0, num_blocks * BLOCK_M, LANES):  # the padding: rows past their expert's assignments
        rows = r0 + lane
        row_expert = tl.sum((padded_end[None, :] <= rows[:, None]).to(tl.int32), axis=1)
        filled_end = tl.sum(tl.where(experts[None, :] == row_expert[:, None], (start + counts)[None, :], 0), axis=1)
        tl.store(sorted_ids_ptr + rows, tl.full((LANES,), 0, tl.int32) + n,
                 mask=(rows >= filled_end) & (rows < num_blocks * BLOCK_M))
    placed = start  # each expert's next free row
    for t0 in range(0, T, BLOCK_T):
        expert, valid, assignment = _block_lanes(
            logits_ptr, bias_ptr, table_ptr, token_ids_ptr, E, stride_l, scaling, weights_ptr, ids_ptr, t0, T,
            SCORING, HAS_BIAS, HASHED, RENORMALIZE, TOP_K, K_POW2, EXPERTS, ROUND_TO, SHARED, BLOCK_T, False, ALIGNED)
        same = expert[:, None] == experts[None, :]
        rank = tl.sum(((expert[:, None] == expert[None, :]) & (lane[None, :] < lane[:, None])).to(tl.int32), axis=1)
        row = tl.sum(tl.where(same, placed[None, :], 0), axis=1) + rank
        tl.store(sorted_ids_ptr + row, assignment.to(tl.int32), mask=valid)
        placed += tl.sum(same.to(tl.int32), axis=0)
    if SHARED_APART:
        _align_every_token(shared_sorted_ids_ptr, shared_block_expert_ptr, shared_num_padded_ptr, T,
                           shared_num_blocks, SHARED_BLOCK_M, LANES)
    _zero(counters_ptr, num_counters, LANES)
    _zero(shared_counters_ptr, num_shared_counters, LANES)


@triton.jit
def _zero(ptr, n, LANES: tl.constexpr):
    lane = tl.arange(0, LANES)
    for i0 in range(0, n, LANES):
        tl.store(ptr + i0 + lane, tl.zeros((LANES,), tl.int32), mask=i0 + lane < n)


@triton.jit
def _align_every_token(sorted_ids_ptr, block_expert_ptr, num_padded_ptr, T, num_blocks, BLOCK_M: tl.constexpr,
                       LANES: tl.constexpr):
    """The alignment of a column every token takes, for a stack of one expert: row r holds token r,
    padded to BLOCK_M rows."""
    lane = tl.arange(0, LANES)
    used = tl.cdiv(T, BLOCK_M)
    for r0 in range(0, num_blocks * BLOCK_M, LANES):
        rows = r0 + lane
        tl.store(sorted_ids_ptr + rows, tl.minimum(rows, T), mask=rows < num_blocks * BLOCK_M)
    for b0 in range(0, num_blocks, LANES):
        blocks = b0 + lane
        tl.store(block_expert_ptr + blocks, tl.where(blocks < used, 0, -1), mask=blocks < num_blocks)
    tl.store(num_padded_ptr, used * BLOCK_M)


def block_tokens(cfg: RoutingConfig, num_experts: int, arch: str) -> int:
    """Tokens a pass takes at once: their logits within a routing tile, their lanes within the
    dispatch's and, against a stack of ``num_experts``, within its one-hot budget."""
    tile, _ = pick(ROUTE_TILE, arch)
    dispatch = pick(DISPATCH, arch)
    lanes = min(dispatch.lanes, dispatch.one_hot // triton.next_power_of_2(num_experts))
    per_token = triton.next_power_of_2(route_width(cfg))
    return triton.next_power_of_2(max(1, min(tile // triton.next_power_of_2(cfg.num_experts), lanes // per_token)))


def fits_one_program(num_tokens: int, cfg: RoutingConfig, device: torch.device) -> bool:
    """Whether ``route_and_align`` takes this many tokens (a decode step's batch, ungrouped routing)."""
    return 0 < num_tokens <= pick(DISPATCH, arch_of(device)).tokens and cfg.num_groups == 1


def route_and_align(router_logits: torch.Tensor, cfg: RoutingConfig, input_ids: torch.Tensor | None,
                    num_experts: int, block_m: int, shared_block_m: int | None = None, *,
                    arrival_counts: int | None = None, shared_arrival_counts: int | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, ExpertBlocks, ExpertBlocks | None]:
    """[T, E] logits -> (weights [T, K] fp32, expert ids [T, K] int64, their ``ExpertBlocks`` over a
    stack of ``num_experts`` in blocks of ``block_m`` rows, None), K = top_k (+ 1 with a shared
    expert), in one launch; only where ``fits_one_program``. ``shared_block_m``: the shared expert
    has a stack of its own; the blocks are then the routed columns' (``ids[:, :top_k]``), and the
    fourth item the shared column's in blocks of that many rows. ``arrival_counts`` (and
    ``shared_arrival_counts``): the blocks carry counters for the experts' one launch, zeroed here."""
    routes, args, constexprs = dispatch_arguments(router_logits, cfg, input_ids, num_experts, block_m, shared_block_m,
                                                  arrival_counts, shared_arrival_counts)
    device = router_logits.device
    _route_align_kernel[(1,)](*args, **constexprs, num_warps=pick(ROUTE_TILE, arch_of(device))[1],
                              **launch_options(device))
    return routes


def dispatch_arguments(router_logits: torch.Tensor, cfg: RoutingConfig, input_ids: torch.Tensor | None,
                       num_experts: int, block_m: int, shared_block_m: int | None, arrival_counts: int | None,
                       shared_arrival_counts: int | None) -> tuple[tuple, tuple, dict]:
    """What ``route_and_align`` returns, allocated, with ``route_align``'s arguments that write it
    (tensors and scalars, constexprs), checked; the logits are read only once the kernel runs."""
    t, device = router_logits.shape[0], router_logits.device
    if not fits_one_program(t, cfg, device):
        raise ValueError(f"{t} tokens of {cfg.num_experts} experts, top {cfg.top_k} (groups {cfg.num_groups}) "
                         "do not fit one program; route and align apart")
    apart = shared_block_m is not None
    if apart and cfg.shared_expert is None:
        raise ValueError("a shared expert's own alignment needs a routing with a shared expert")
    if not apart and cfg.shared_expert is not None and cfg.shared_expert >= num_experts:
        raise ValueError(f"shared expert {cfg.shared_expert} is not in a stack of {num_experts}")
    args, constexprs = routing_arguments(router_logits, cfg, input_ids)
    width = route_width(cfg)
    weights = torch.empty(t, width, dtype=torch.float32, device=device)
    ids = torch.empty(t, width, dtype=torch.int64, device=device)
    blocks = unfilled_blocks(t * (cfg.top_k if apart else width), num_experts, block_m, device, arrival_counts)
    shared = unfilled_blocks(t, 1, shared_block_m, device, shared_arrival_counts) if apart else None
    # no counters: zero words of an int32 tensor (a compiled kernel cannot store through None)
    counters = [(blocks.sorted_ids, 0) if b is None or b.counters is None else (b.counters, b.counters.numel())
                for b in (blocks, shared)]
    shared_args = (shared.sorted_ids, shared.block_expert, shared.num_padded, shared.num_blocks) if apart else \
        (None, None, None, 0)
    arch = arch_of(device)
    args = (*args, weights, ids, blocks.sorted_ids, blocks.block_expert, blocks.num_padded, t, num_experts,
            blocks.num_blocks, *shared_args, *counters[0], *counters[1])
    constexprs = dict(**constexprs, BLOCK_T=min(block_tokens(cfg, num_experts, arch), triton.next_power_of_2(t)),
                      BLOCK_M=block_m, STACK_EXPERTS=triton.next_power_of_2(num_experts),
                      SCAN_BLOCKS=pick(ALIGN, arch).scan_blocks, SHARED_APART=apart, SHARED_BLOCK_M=shared_block_m or 1)
    return (weights, ids, blocks, shared), args, constexprs
