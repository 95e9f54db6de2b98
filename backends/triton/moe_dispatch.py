"""A decode step's MoE dispatch on one GPU in one launch: the routing and the alignment by expert.

What ``moe_routing.route`` and then ``moe_align.align_by_expert`` compute, to the bit, in one
program: the routing of every token (``route_rows``), the weights and ids stored for the combine,
then the same ids, still in registers, laid out one assignment a lane in assignment order (token
t's slot k is lane t * K_POW2 + k, the slots past the route's width idle) and aligned
(``align_lanes``). Nothing is read back from memory between the two halves, so no barrier is
needed and the result does not depend on how a target orders a program's global stores.

One program holds every token's logits and every pair of assignments, so this is for decode:
``fits_one_program`` says when (tokens x experts within a routing tile, tokens x route width within
an alignment chunk); a larger batch routes and aligns in their own launches. Grouped top-k stays
native, as in ``TritonMoE.route``.

The seam for expert-parallel dispatch is the routing this kernel stores: a dispatcher across GPUs
takes (weights, ids) as ``route`` gives them and aligns what it receives (``align_by_expert``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.core.families.moe import RoutingConfig

from .moe_align import ALIGN, ExpertBlocks, align_lanes, unfilled_blocks
from .moe_routing import ROUTE_TILE, route_rows, route_width, routing_arguments, store_routes
from .pdl import launch_options, wait_for_prior
from .target import config_for


@triton.jit
def _route_align_kernel(logits_ptr, bias_ptr, table_ptr, token_ids_ptr, E, stride_l, scaling,
                        weights_ptr, ids_ptr, sorted_ids_ptr, block_expert_ptr, num_padded_ptr, T, num_experts,
                        num_blocks, SCORING: tl.constexpr, HAS_BIAS: tl.constexpr, HASHED: tl.constexpr,
                        RENORMALIZE: tl.constexpr, TOP_K: tl.constexpr, K_POW2: tl.constexpr,
                        EXPERTS: tl.constexpr, ROUND_TO: tl.constexpr, SHARED: tl.constexpr, BLOCK_T: tl.constexpr,
                        BLOCK_M: tl.constexpr, STACK_EXPERTS: tl.constexpr, SCAN_BLOCKS: tl.constexpr,
                        PDL: tl.constexpr):
    """weights and ids [T, WIDTH] as ``_route_kernel`` stores them, and their alignment over a stack of
    ``num_experts`` (STACK_EXPERTS its power of two; a folded shared expert is the stack's last) as
    ``_align_one_chunk_kernel`` stores it; T <= BLOCK_T."""
    wait_for_prior(PDL)
    WIDTH: tl.constexpr = TOP_K + (SHARED >= 0)
    LANES: tl.constexpr = BLOCK_T * K_POW2
    rows = tl.arange(0, BLOCK_T)
    live = rows < T
    chosen, picked = route_rows(logits_ptr, bias_ptr, table_ptr, token_ids_ptr, rows, live, E, stride_l, scaling,
                                SCORING, HAS_BIAS, HASHED, RENORMALIZE, TOP_K, K_POW2, EXPERTS, BLOCK_T, ROUND_TO,
                                SHARED)
    store_routes(weights_ptr, ids_ptr, rows, live, chosen, picked, WIDTH, K_POW2)
    lane = tl.arange(0, LANES)
    token, slot = lane // K_POW2, lane % K_POW2
    valid = (token < T) & (slot < WIDTH)
    expert = tl.where(valid, tl.reshape(chosen, (LANES,)), -1)
    align_lanes(expert, valid, token * WIDTH + slot, T * WIDTH, sorted_ids_ptr, block_expert_ptr, num_padded_ptr,
                num_experts, num_blocks, BLOCK_M, LANES, STACK_EXPERTS, SCAN_BLOCKS)


def fits_one_program(num_tokens: int, cfg: RoutingConfig, device: torch.device) -> bool:
    """Whether ``route_and_align`` takes this many tokens: their logits fit a routing tile and their
    assignment lanes an alignment chunk (a decode step's batch)."""
    block_t = triton.next_power_of_2(max(num_tokens, 1))
    tile, _ = config_for(ROUTE_TILE, device)
    return (0 < num_tokens and cfg.num_groups == 1 and block_t * triton.next_power_of_2(cfg.num_experts) <= tile
            and block_t * triton.next_power_of_2(route_width(cfg)) <= config_for(ALIGN, device).chunk)


def route_and_align(router_logits: torch.Tensor, cfg: RoutingConfig, input_ids: torch.Tensor | None,
                    num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, ExpertBlocks]:
    """[T, E] logits -> (weights [T, K] fp32, expert ids [T, K] int64, their ``ExpertBlocks`` over a
    stack of ``num_experts`` in blocks of ``block_m`` rows), K = top_k (+ 1 with a shared expert), in
    one launch; only where ``fits_one_program``."""
    t, device = router_logits.shape[0], router_logits.device
    if not fits_one_program(t, cfg, device):
        raise ValueError(f"{t} tokens of {cfg.num_experts} experts, top {cfg.top_k} (groups {cfg.num_groups}) "
                         "do not fit one program; route and align apart")
    if cfg.shared_expert is not None and cfg.shared_expert >= num_experts:
        raise ValueError(f"shared expert {cfg.shared_expert} is not in a stack of {num_experts}")
    args, constexprs = routing_arguments(router_logits, cfg, input_ids)
    width = route_width(cfg)
    weights = torch.empty(t, width, dtype=torch.float32, device=device)
    ids = torch.empty(t, width, dtype=torch.int64, device=device)
    blocks = unfilled_blocks(t * width, num_experts, block_m, device)
    align = config_for(ALIGN, device)
    _, num_warps = config_for(ROUTE_TILE, device)
    _route_align_kernel[(1,)](
        *args, weights, ids, blocks.sorted_ids, blocks.block_expert, blocks.num_padded, t, num_experts,
        blocks.num_blocks, **constexprs, BLOCK_T=triton.next_power_of_2(t), BLOCK_M=block_m,
        STACK_EXPERTS=triton.next_power_of_2(num_experts), SCAN_BLOCKS=align.scan_blocks, num_warps=num_warps,
        **launch_options(device))
    return weights, ids, blocks
