"""A decode step's experts in one launch: gate/up with SwiGLU, then down with the weighted combine.

The same tiles as the two grouped GEMMs of fused_moe.py (``expert_tile``), taken by the programs of
one launch: first every gate/up tile, block by block, then every down tile, block by block. A gate/up
tile stores its SwiGLU rows and then counts itself into its block's flag (a barrier, then an integer
atomic with release semantics at GPU scope); a down tile of that block first waits until the flag
holds all of the block's gate/up tiles (acquire), then reads the rows past L1. So the down GEMM of
an expert's rows starts as soon as that expert's gate/up tiles are written, with no launch between,
and the [T * top_k, I] intermediate stays in L2 at decode sizes.

Why it never deadlocks: a program does not take the tile of its program id but a ticket, from an
atomic counter, and ticket order is tile order (all gate/up tiles, then the down tiles). A program
that waits holds a down tile and waits only for gate/up tiles, whose tickets are smaller: they were
taken by programs already running (a ticket is taken by a program once it runs), which never wait
themselves, so they finish whatever else is resident and however the hardware schedules programs.

The counters (a flag per block, the ticket, the combine's arrival counts [T, tiles of H]) are zeroed
by the launch before, the routing and alignment (``route_and_align``'s ``arrival_counts``), so
nothing is read on the host, no launch fills them, and a graph replays the pair as captured.
Numerics are those of the two launches, to the bit: the same tiles, roundings and combine order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp8_gemm import GemmConfig, unit_inner_stride
from .fused_moe import FP8, MX_BLOCK, PACKED_FP4, _weight_format, expert_tile, fp8_expert_block, quantizes_in_gemm
from .moe_align import ExpertBlocks
from .moe_tiles import FP4_PTX_UNPACK, FP4_SCALED_MMA, check_fp8_steps, ptx_unpack_fits, stages_that_fit
from .pdl import launch_options, wait_for_prior
from .target import arch_of, config_for, pick

# the fewest warps a program takes: on sm_90 the decode tiles (16 x 64, K steps of 128) of bf16 and
# FP8 weights spill at 4 warps with both GEMMs in one kernel (184 and 349 local loads and stores;
# the gate/up launch's tile alone 196 in bf16), none at 8 (the AOT test reads the SASS)
MIN_WARPS = {"sm_90": 8, "default": 1}


def one_launch_warps(cfg: GemmConfig, arch: str) -> int:
    return max(cfg.num_warps, pick(MIN_WARPS, arch))


def arrival_counts(num_tokens: int, hidden: int, cfg: GemmConfig) -> int:
    """The combine's arrival counts for ``num_tokens`` tokens of ``hidden`` channels in ``cfg``'s tiles."""
    return num_tokens * triton.cdiv(hidden, cfg.block_n)


def _quantizes(gate_up: torch.Tensor, scaled_mma: bool | None) -> bool:
    """Whether the activations are quantized for these weights: FP8, or FP4 where the MMA is
    block-scaled (``scaled_mma``, by default from ``FP4_SCALED_MMA``)."""
    if scaled_mma is None:
        scaled_mma = config_for(FP4_SCALED_MMA, gate_up.device)
    return gate_up.dtype == FP8 or (gate_up.dtype == PACKED_FP4 and scaled_mma)


def fits_one_launch(gate_up: torch.Tensor, cfg: GemmConfig, num_tokens: int, top_k: int,
                    scaled_mma: bool | None = None, gate_up_scale: torch.Tensor | None = None) -> bool:
    """Whether these experts can run in one launch: activations unquantized throughout, or quantized
    in the GEMMs (``quantizes_in_gemm``: decode rows), since no launch may quantize between. FP8
    experts come with their ``gate_up_scale``, whose shape says their blocks."""
    if not _quantizes(gate_up, scaled_mma):
        return True
    return quantizes_in_gemm(cfg, num_tokens, top_k, gate_up.shape[0], gate_up.device,
                             fp8_block=fp8_expert_block(gate_up, gate_up_scale))


@triton.jit
def _moe_one_launch_kernel(x_ptr, gate_up_ptr, gate_up_scale_ptr, down_ptr, down_scale_ptr, h_ptr, rows_ptr, out_ptr,
                           topk_weight_ptr, topk_id_ptr, counters_ptr, sorted_ids_ptr, block_expert_ptr, num_padded_ptr,
                           num_blocks, H, I, num_assignments, swiglu_limit, top_k,
                           stride_xm, stride_ge, stride_gn, stride_gse, stride_gsn,
                           stride_de, stride_dn, stride_dse, stride_dsn, stride_hm, stride_rm, stride_om, stride_wt,
                           stride_it,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           HAS_LIMIT: tl.constexpr, FP8: tl.constexpr, SCALE_BLOCK: tl.constexpr, FP4: tl.constexpr,
                           SCALED_MMA: tl.constexpr, EVEN_H: tl.constexpr, EVEN_I: tl.constexpr,
                           PTX_UNPACK: tl.constexpr, QUANTIZE_A: tl.constexpr, ACCUMULATE: tl.constexpr,
                           PDL: tl.constexpr):
    """x [T, H] -> h [T * top_k, I] (SwiGLU of gate/up) -> rows [T * top_k, H] (down) -> out [T, H]
    (the weighted combine), one tile a program in ticket order (see the module). counters: flags
    [num_blocks], the ticket, arrival counts [T, tiles of H], all zero at the start."""
    wait_for_prior(PDL)
    inner_tiles = tl.cdiv(I, BLOCK_N)
    hidden_tiles = tl.cdiv(H, BLOCK_N)
    arrivals_ptr = counters_ptr + num_blocks + 1
    tile = tl.atomic_add(counters_ptr + num_blocks, 1, sem="relaxed", scope="gpu")
    num_padded = tl.load(num_padded_ptr)
    gate_up_tiles = num_blocks * inner_tiles
    if tile < gate_up_tiles:
        pid_m = tile // inner_tiles
        if pid_m * BLOCK_M < num_padded:
            expert_tile(pid_m, tile % inner_tiles, x_ptr, None, gate_up_ptr, gate_up_scale_ptr, h_ptr, None, None,
                        None, arrivals_ptr, sorted_ids_ptr, block_expert_ptr, I, H, num_assignments, top_k,
                        swiglu_limit, top_k, hidden_tiles, stride_xm, 0, stride_ge, stride_gn, stride_gse, stride_gsn,
                        stride_hm, 0, 0, 0, BLOCK_M, BLOCK_N, BLOCK_K, True, HAS_LIMIT, FP8, SCALE_BLOCK, FP4,
                        SCALED_MMA, EVEN_H, PTX_UNPACK, QUANTIZE_A, False, False, "")
            tl.debug_barrier()  # every row of the tile stored before it is counted
            tl.atomic_add(counters_ptr + pid_m, 1, sem="release", scope="gpu")
    else:
        pid_m = (tile - gate_up_tiles) // hidden_tiles
        if pid_m * BLOCK_M < num_padded:
            while tl.atomic_add(counters_ptr + pid_m, 0, sem="acquire", scope="gpu") < inner_tiles:
                pass
            tl.debug_barrier()
            expert_tile(pid_m, (tile - gate_up_tiles) % hidden_tiles, h_ptr, None, down_ptr, down_scale_ptr, rows_ptr,
                        out_ptr, topk_weight_ptr, topk_id_ptr, arrivals_ptr, sorted_ids_ptr, block_expert_ptr, H, I,
                        num_assignments, 1, swiglu_limit, top_k, hidden_tiles, stride_hm, 0, stride_de, stride_dn,
                        stride_dse, stride_dsn, stride_rm, stride_om, stride_wt, stride_it, BLOCK_M, BLOCK_N, BLOCK_K,
                        False, HAS_LIMIT, FP8, SCALE_BLOCK, FP4, SCALED_MMA, EVEN_I, PTX_UNPACK, QUANTIZE_A,
                        ACCUMULATE, False, ".cg")


def moe_one_launch(x: torch.Tensor, blocks: ExpertBlocks, gate_up: torch.Tensor, down: torch.Tensor,
                   topk_weights: torch.Tensor, topk_ids: torch.Tensor, cfg: GemmConfig, out: torch.Tensor, *,
                   swiglu_limit: float | None, gate_up_scale: torch.Tensor | None, down_scale: torch.Tensor | None,
                   accumulate: bool = False, scaled_mma: bool | None = None) -> torch.Tensor:
    """What ``fused_moe`` writes into ``out`` [T, H] (``accumulate``: adds to it), in one launch where
    ``fits_one_launch``; ``blocks`` must carry their counters, zeroed (``route_and_align``), and be
    aligned in ``cfg``'s rows from ``topk_ids`` (-1: no expert, as in ``fused_moe``). FP8 and MXFP8
    activations are quantized tile by tile as loaded; ``scaled_mma`` as in ``fused_moe``."""
    quantize = _quantizes(gate_up, scaled_mma)
    if blocks.counters is None or blocks.block_m != cfg.block_m:
        raise ValueError("one launch needs blocks of the config's rows with their zeroed counters")
    x, gate_up, down = unit_inner_stride(x, gate_up, down)
    fmt = _weight_format(x, None, gate_up, gate_up_scale, quantize)
    block = fp8_expert_block(gate_up, gate_up_scale)
    if fmt == "fp8_block":
        if fp8_expert_block(down, down_scale) != block:
            raise ValueError(f"gate_up scales {list(gate_up_scale.shape)} and down scales {list(down_scale.shape)} "
                             f"are not of one block edge")
        check_fp8_steps(cfg, block, True)
    fp4 = fmt.startswith("fp4")
    num_tokens, hidden = x.shape
    inner = gate_up.shape[1] // 2
    words = blocks.num_blocks + 1 + arrival_counts(num_tokens, hidden, cfg)
    if (blocks.counters.numel() != words or topk_weights.shape[0] != num_tokens
            or topk_ids.shape != topk_weights.shape):
        raise ValueError(f"counters of {blocks.counters.numel()} words for {words}, or routing weights "
                         f"{list(topk_weights.shape)} and ids {list(topk_ids.shape)} not of {num_tokens} tokens")
    if blocks.num_blocks == 0:
        return out
    h = torch.empty(blocks.num_assignments, inner, dtype=x.dtype, device=x.device)
    rows = torch.empty(blocks.num_assignments, hidden, dtype=out.dtype, device=x.device)
    weights = topk_weights.float()
    weights = weights if weights.stride(1) == 1 else weights.contiguous()
    topk_ids = topk_ids if topk_ids.stride(1) == 1 else topk_ids.contiguous()
    scales = [(0, 0) if s is None else (s.stride(0), s.stride(1)) for s in (gate_up_scale, down_scale)]
    grid = (blocks.num_blocks * (triton.cdiv(inner, cfg.block_n) + triton.cdiv(hidden, cfg.block_n)),)
    _moe_one_launch_kernel[grid](
        x, gate_up, gate_up_scale, down, down_scale, h, rows, out, weights, topk_ids, blocks.counters,
        blocks.sorted_ids, blocks.block_expert, blocks.num_padded, blocks.num_blocks, hidden, inner,
        blocks.num_assignments, 0.0 if swiglu_limit is None else float(swiglu_limit), weights.shape[1],
        x.stride(0), gate_up.stride(0), gate_up.stride(1), *scales[0], down.stride(0), down.stride(1), *scales[1],
        h.stride(0), rows.stride(0), out.stride(0), weights.stride(0), topk_ids.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, HAS_LIMIT=swiglu_limit is not None,
        FP8=fmt == "fp8_block", SCALE_BLOCK=MX_BLOCK if fp4 else block or MX_BLOCK, FP4=fp4, SCALED_MMA=fmt == "fp4_scaled",
        EVEN_H=hidden % cfg.block_k == 0, EVEN_I=inner % cfg.block_k == 0,
        PTX_UNPACK=(fmt == "fp4" and x.dtype == torch.bfloat16 and config_for(FP4_PTX_UNPACK, x.device)
                    and ptx_unpack_fits(cfg)),
        QUANTIZE_A=quantize, ACCUMULATE=accumulate, num_warps=one_launch_warps(cfg, arch_of(x.device)),
        num_stages=stages_that_fit(cfg, x, gate_up, True, fp4), **launch_options(x.device))
    return out
