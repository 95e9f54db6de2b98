"""A batch-1 decode step's MoE router, routing and alignment in one launch: the router's GEMV, then
the dispatch (moe_dispatch.py) in the program that finishes the GEMV last.

The grid is the router's own GEMV launch (gemv.py): the same bands of experts, the same tiles and
the same rounding of the logits to x's dtype, so the logits are those of ``gemv(x, gate)`` to the
bit. Each program stores its band of the logits and counts itself in at a counter (a barrier, then
an acq_rel atomic at GPU scope, as the mHC boundary and the split decode attention count theirs);
the one that arrives last sees every band, sets the counter back to 0 for the next launch (and
every graph replay) and runs ``route_align`` for the step, which is what the dispatch's own launch
ran, one program, on the logits just written (from L2). No program waits for another.

Why it should not be slower on a GPU: the GEMV programs read the same bytes as before; the routing
runs on one SM once the last band is in, where its launch of its own would have started after the
GEMV kernel drained and the next kernel launched (PDL only hides part of that gap). The kernel takes
the GEMV's warps; the routing of one token is a pass of one token's lanes, which the AOT test
compiles without spills or scratch at DeepSeek-V4-Flash's shape.

Only one row: the linear backend runs the router as this GEMV for one row of x, and more rows go to
a GEMM, whose logits these would not be; a larger decode batch projects and dispatches apart.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.core.families.moe import RoutingConfig

from .attention_decode import arrival_counters
from .fp8_gemm import unit_inner_stride
from .gemv import GEMV, _band_product, fits
from .moe_align import ExpertBlocks
from .moe_dispatch import dispatch_arguments, route_align
from .pdl import launch_options, wait_for_prior
from .target import config_for


@triton.jit
def _project_route_align_kernel(logits_ptr, bias_ptr, table_ptr, token_ids_ptr, E, stride_l, scaling,
                                weights_ptr, ids_ptr, sorted_ids_ptr, block_expert_ptr, num_padded_ptr, T,
                                num_experts, num_blocks, shared_sorted_ids_ptr, shared_block_expert_ptr,
                                shared_num_padded_ptr, shared_num_blocks, counters_ptr, num_counters,
                                shared_counters_ptr, num_shared_counters, x_ptr, gate_ptr, tickets_ptr, K, stride_gn,
                                SCORING: tl.constexpr, HAS_BIAS: tl.constexpr, HASHED: tl.constexpr,
                                RENORMALIZE: tl.constexpr, TOP_K: tl.constexpr, K_POW2: tl.constexpr,
                                EXPERTS: tl.constexpr, ROUND_TO: tl.constexpr, SHARED: tl.constexpr,
                                BLOCK_T: tl.constexpr, BLOCK_M: tl.constexpr, STACK_EXPERTS: tl.constexpr,
                                SCAN_BLOCKS: tl.constexpr, SHARED_APART: tl.constexpr, SHARED_BLOCK_M: tl.constexpr,
                                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                                PDL: tl.constexpr):
    """Program n: logits[0, band n] = x [1, K] @ gate[band n].T, rounded to the logits' dtype; the last
    program to arrive at ``tickets_ptr`` then routes and aligns (``route_align``'s arguments first)."""
    wait_for_prior(PDL)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = (rn % E).to(tl.int64)  # experts past E reread the last one; they are not stored
    acc = _band_product(x_ptr, x_ptr, x_ptr, tl.zeros([1], tl.float32), gate_ptr + rows[:, None] * stride_gn, x_ptr,
                        1, K, 0, 0, tl.arange(0, BLOCK_K), 1, BLOCK_N, BLOCK_K, EVEN_K, False, False, False, 0)
    tl.store(logits_ptr + rn[None, :], acc.to(logits_ptr.dtype.element_ty), mask=rn[None, :] < E)
    tl.debug_barrier()  # every thread's stores before the release
    if tl.atomic_add(tickets_ptr, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
        tl.store(tickets_ptr, 0)
        route_align(logits_ptr, bias_ptr, table_ptr, token_ids_ptr, E, stride_l, scaling, weights_ptr, ids_ptr,
                    sorted_ids_ptr, block_expert_ptr, num_padded_ptr, T, num_experts, num_blocks,
                    shared_sorted_ids_ptr, shared_block_expert_ptr, shared_num_padded_ptr, shared_num_blocks,
                    counters_ptr, num_counters, shared_counters_ptr, num_shared_counters, SCORING, HAS_BIAS, HASHED,
                    RENORMALIZE, TOP_K, K_POW2, EXPERTS, ROUND_TO, SHARED, BLOCK_T, BLOCK_M, STACK_EXPERTS,
                    SCAN_BLOCKS, SHARED_APART, SHARED_BLOCK_M)


def projects_in_dispatch(x: torch.Tensor, gate: torch.Tensor) -> bool:
    """Whether ``project_route_and_align`` takes these: one row of x, a plain float router weight of
    x's dtype (what the linear backend runs as the GEMV)."""
    return x.dim() == 2 and x.shape[0] == 1 and x.dtype == gate.dtype and fits(x, gate)


def project_route_and_align(x: torch.Tensor, gate: torch.Tensor, cfg: RoutingConfig, input_ids: torch.Tensor | None,
                            num_experts: int, block_m: int, shared_block_m: int | None = None, *,
                            arrival_counts: int | None = None, shared_arrival_counts: int | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor, ExpertBlocks, ExpertBlocks | None]:
    """``route_and_align(gemv(x, gate), cfg, input_ids, ...)``, the same to the bit, in one launch;
    x [1, H], gate [E, H]; only where ``projects_in_dispatch``."""
    if not projects_in_dispatch(x, gate) or gate.shape[1] != x.shape[1]:
        raise ValueError(f"x {list(x.shape)} {x.dtype} and router weight {list(gate.shape)} {gate.dtype} are not "
                         "one row against a plain float weight of its dtype; project and dispatch apart")
    logits = torch.empty(1, gate.shape[0], dtype=x.dtype, device=x.device)
    routes, args, constexprs = dispatch_arguments(logits, cfg, input_ids, num_experts, block_m, shared_block_m,
                                                  arrival_counts, shared_arrival_counts)
    x, gate = unit_inner_stride(x, gate)
    k = x.shape[1]
    gemv = config_for(GEMV, x.device).for_shape(1, k)
    _project_route_align_kernel[(triton.cdiv(gate.shape[0], gemv.block_n),)](
        *args, x, gate, arrival_counters(1, x.device), k, gate.stride(0), **constexprs, BLOCK_N=gemv.block_n,
        BLOCK_K=gemv.block_k, EVEN_K=k % gemv.block_k == 0, num_warps=gemv.num_warps, num_stages=gemv.num_stages,
        **launch_options(x.device))
    return routes
