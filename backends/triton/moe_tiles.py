"""The fused MoE's tiles on each target, and the checks that a tile fits its weights.

The tables live apart from the kernels (fused_moe.py, moe_one_launch.py) because both launch from
them and the AOT tests compile every entry: a tile is chosen to compile without spills on its
target (the tests read the SASS or the AMD scratch), which the comments beside each entry record.
"""

from __future__ import annotations

import torch

from .fp8_gemm import GemmConfig, GemmTuning
from .fp8_quant import GROUP
from .target import arch_of, config_for, pick

# targets whose block-scaled MMA takes E2M1 weights with MXFP8 activations (tl.dot_scaled lowers to it);
# elsewhere triton would only emulate it, so FP4 tiles are dequantized in registers for an ordinary dot
FP4_SCALED_MMA = {"sm_100": True, "gfx950": True, "default": False}
# targets that unpack bf16 FP4 rows with inline PTX (fp4.py); the others with portable operations
FP4_PTX_UNPACK = {"cuda": True, "default": False}
# the PTX packs four bytes of a thread's registers into a word as if they were adjacent in the tile,
# which holds when each thread holds one 16-byte vector of the packed weight tile: on an H100 every
# tile of 16 bytes a thread unpacked right (12 configs) and every one of 32, 64 or 128 wrong (52)
PTX_UNPACK_BYTES_PER_THREAD = 16


def ptx_unpack_fits(cfg: GemmConfig) -> bool:
    """Whether ``cfg``'s packed FP4 weight tile gives each thread exactly one 16-byte vector."""
    return cfg.block_n * cfg.block_k // 2 == PTX_UNPACK_BYTES_PER_THREAD * 32 * cfg.num_warps

# small: decode, a few rows per expert, so narrow N tiles spread each expert's weights over every
# SM; large: prefill, full matrix-unit tiles. ``small_m`` counts rows per expert (T * top_k / E).
# block_k divides 128 so that an FP8 K step stays inside one scale block.
# On sm_90 and sm_100 the tiles are the largest that compile without spills (the AOT test reads the
# SASS of each, bf16 and 128-block FP8): the gated tile holds two fp32 accumulators, and FP8 scales
# each K step's products in registers before adding them (a decode tile also quantizes its
# activations there), so a thread holds several BLOCK_M x BLOCK_N / threads arrays besides the
# operands, against 255 registers a thread (64K a SM). At 4 warps the 16 x 64 decode tile spilled
# (gated: 385 local loads and stores in FP8 on sm_90, 196 in bf16; 297 FP8 on sm_100), as did
# 64 x 128 for prefill on sm_90 (gated FP8 509, down 83, gated bf16 374; at 8 warps gated FP8
# still 208) and 128 x 128 on sm_100 (gated FP8 3920, down 409); 64 x 64 on 8 warps spills in
# none. Chosen to compile without spills, not measured on a GPU.
MOE_GEMM = {
    "sm_90": GemmTuning(GemmConfig(16, 64, 128, 1, 8, 4), GemmConfig(64, 64, 64, 8, 8, 3), small_m=16),
    "sm_100": GemmTuning(GemmConfig(16, 64, 128, 1, 8, 4), GemmConfig(64, 64, 64, 8, 8, 3), small_m=16),
    "gfx942": GemmTuning(GemmConfig(16, 64, 128, 1, 4, 2), GemmConfig(64, 128, 64, 8, 4, 2), small_m=16),
    "gfx950": GemmTuning(GemmConfig(16, 64, 128, 1, 4, 2), GemmConfig(64, 128, 64, 8, 4, 2), small_m=16),
    "default": GemmTuning(GemmConfig(16, 32, 32, 1, 4, 1), GemmConfig(32, 32, 64, 2, 4, 1), small_m=2),
}

# FP8 experts in DeepSeek-V4.1's 32-blocks: K steps of 32, so the accumulators are scaled four times
# as often; on sm_90 and sm_100 the prefill tile is 64 x 64 on 8 warps, where 64 x 128 spilled (the
# gated tile: 231 local loads and stores on sm_90 at 4 warps, 73 at 8; 331 on sm_100) and so did
# 128 x 128 on sm_100 (956); the AOT test reads the SASS. Not measured on a GPU.
MOE_GEMM_32 = {
    "sm_90": GemmTuning(GemmConfig(16, 64, 32, 1, 4, 4), GemmConfig(64, 64, 32, 8, 8, 3), small_m=16),
    "sm_100": GemmTuning(GemmConfig(16, 64, 32, 1, 4, 4), GemmConfig(64, 64, 32, 8, 8, 3), small_m=16),
    "gfx942": GemmTuning(GemmConfig(16, 64, 32, 1, 4, 2), GemmConfig(64, 128, 32, 8, 4, 2), small_m=16),
    "gfx950": GemmTuning(GemmConfig(16, 64, 32, 1, 4, 2), GemmConfig(64, 128, 32, 8, 4, 2), small_m=16),
    "default": GemmTuning(GemmConfig(16, 32, 32, 1, 4, 1), GemmConfig(32, 32, 32, 2, 4, 1), small_m=2),
}
MOE_TUNING = {128: MOE_GEMM, 32: MOE_GEMM_32}  # FP8 block edge (128 also for bf16 experts) -> its table

# FP4 experts: as above, but sm_100 keeps 128-row blocks for decode too, since tl.dot_scaled falls
# back to a bf16 emulation below that (as in mxfp8.py); on sm_90, where the gated tile unpacks two
# weight tiles in registers, decode tiles take 8 warps and prefill tiles are 64 wide, which is what
# keeps them from spilling (4 warps: 27 local loads and stores; 128 wide: over 500). On sm_100 the
# 128-row tiles take 8 warps: at 4 the gated decode tile (quantizing its activations to MXFP8)
# spilled 402 and the 128 x 128 prefill tile 516. The AOT test reads the SASS; not measured on a GPU.
MOE_FP4_GEMM = {**MOE_GEMM,
                "sm_90": GemmTuning(GemmConfig(16, 64, 128, 1, 8, 4), GemmConfig(64, 64, 64, 8, 4, 3), small_m=16),
                "sm_100": GemmTuning(GemmConfig(128, 64, 128, 1, 8, 4), GemmConfig(128, 128, 128, 8, 8, 3),
                                     small_m=16)}


def moe_config(num_tokens: int, top_k: int, num_experts: int, device: torch.device, fp4: bool = False,
               fp8_block: int = GROUP) -> GemmConfig:
    """The launch parameters for the rows an expert gets on average; FP8 experts in blocks of
    ``fp8_block`` from that edge's table."""
    return config_for(MOE_FP4_GEMM if fp4 else MOE_TUNING[fp8_block], device).for_m(-(-num_tokens * top_k // num_experts))


# the bytes of A and B tiles a program's pipeline stages may take: under the 227 KiB an sm_90 or sm_100
# program may take, with room for scales; a CDNA3 (gfx942) workgroup's LDS is 64 KiB, a CDNA4's 160
SMEM_BUDGET = {"cuda": 200 << 10, "hip": 64 << 10, "gfx950": 160 << 10, "default": 200 << 10}


def stages_that_fit(cfg: GemmConfig, a: torch.Tensor, b: torch.Tensor, gated: bool, fp4: bool) -> int:
    return stages_within(cfg, arch_of(a.device), a.element_size(), b.element_size(), gated, fp4)


def stages_within(cfg: GemmConfig, arch: str, a_bytes: int, b_bytes: int, gated: bool, fp4: bool) -> int:
    """The pipeline stages whose A and B tiles (of ``a_bytes`` and ``b_bytes`` a value) fit ``arch``'s
    shared memory: fp32 tiles are twice bf16's (three stages of the large gated tile need 240 KiB;
    on gfx942 two stages of fp32 gated tiles took 72 and 80 KiB of LDS)."""
    b_tile = cfg.block_k * cfg.block_n * b_bytes // (2 if fp4 else 1)
    per_stage = cfg.block_m * cfg.block_k * a_bytes + b_tile * (2 if gated else 1)
    return max(1, min(cfg.num_stages, pick(SMEM_BUDGET, arch) // per_stage))


def check_fp8_steps(cfg: GemmConfig, block: int, quantize_a: bool) -> None:
    """FP8 experts in blocks of ``block`` need K steps within a block, and activations quantized in
    the GEMM need steps of exactly one block (one scale group of each row)."""
    if block % cfg.block_k or (quantize_a and cfg.block_k != block):
        raise ValueError(f"FP8 experts in {block}-blocks need K steps {'of' if quantize_a else 'dividing'} "
                         f"{block}{' (activations quantized in the GEMM)' if quantize_a else ''}, not {cfg.block_k}")
