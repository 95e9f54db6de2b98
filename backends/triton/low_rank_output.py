"""DeepSeek-V4's grouped low-rank output projection, both halves in one launch for a decode step:
o [M, G, K] through each group's [R, K] block of wo_a (MXFP8, block-FP8 or dense), rounded to the activations'
dtype, then through wo_b [H, G * R] (dense, that dtype) -> [M, H].

The grid is the first half's (mxfp8.py's grouped GEMM): program (n, g) computes its BLOCK_N of
group g's R low-rank values, rounds them as the first half's output is rounded, and multiplies
them at once by the BLOCK_N columns of wo_b they meet, for every output column in steps of
BLOCK_H, adding the [M, H] partial products into an fp32 accumulator with relaxed atomics. So
the [M, G * R] intermediate never reaches memory, and wo_b is read once, split over the programs
by its columns as wo_a is by its rows. Each program then counts itself in at a ticket (a barrier,
then an acq_rel atomic at GPU scope, as the MoE router's launch counts its bands); the one that
arrives last reads every sum with an atomic (plain loads, even past L1, read zeros where the
reductions had not landed: whole warps' columns on an H100), writes the output rounded to the
activations' dtype, and sets the accumulator and the ticket back to zero for the next launch (and
every graph replay). No program waits for another.

At DeepSeek-V4-Flash's shape (G 8, R 1024, K 4096, H 4096; MXFP8 wo_a 33 MB, bf16 wo_b 64 MB) the
grid is 8 x 16 programs of BLOCK_N 64, each reading 0.26 MB of wo_a and 0.5 MB of wo_b: the bytes
of the two launches it replaces, over as many programs as the first half had alone (wo_b's GEMV
had 2048 programs of 2 rows). The atomics are M * H per program, 2 MB of fp32 reductions in L2 a
row against 97 MB of weights read from HBM; the last program's pass over the accumulator is M * H
values. Past ``MAX_ROWS`` rows the reductions grow with M while the weights do not, and the two
GEMMs run apart.

Numerically: the same products as the two launches, the intermediate rounded as before, but the
sum over wo_b's G * R columns is taken in fp32 in arrival order (BLOCK_N columns a program, then
the programs' partial sums in whatever order their atomics land), where the GEMV summed its K in
fixed steps: the fp32 sums differ by reassociation (a few fp32 ulps of the largest partial sum),
which can move the output's final rounding by one ulp of its dtype, and on a GPU runs are not
bit-reproducible. In the interpreter programs run in order, so it is deterministic there.

wo_b may be block-FP8 as DeepSeek publishes it (E4M3, fp32 scales of 128 x 128 blocks; V4.1's
32 x 32): each [BLOCK_N, BLOCK_H] tile is scaled by its blocks' scales in registers and rounded to
the activations' dtype, the weight gemv.py's block-FP8 GEMV multiplies in the second launch, so
the published checkpoint's decode takes the one launch too. gemv.py's ``_block_scaled`` scales the
tile, whose runs here are along wo_b's rows (each output column step starts on a block's run); the
tile's columns start anywhere in a block (a group's R need not fill whole blocks), so each column
takes its own scale.

wo_a may be block-FP8 too, as DeepSeek-V4.1 publishes it (E4M3, fp32 scales of 32 x 32 blocks; 128
serves the same way) against unquantized o: the low-rank tile is then the block-FP8 GEMV's band
(gemv.py's ``_band_product``), each K step's E4M3 tile scaled by ``_block_scaled`` in registers,
rounded to o's dtype (native's dequantized weight) and multiplied by o as it is, where the two
launches quantize o per token and 32 channels for the grouped block GEMM first. Its rows need no
block alignment (each takes its own scale row), and its K steps, 64 or 32 of K, divide or are
multiples of either block edge. MXFP8 o against a block-FP8 wo_a (sm_100 and gfx950, where the
attention emits it) is not fused: its two launches serve it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention_decode import arrival_counters, kept_zero
from .fp8_gemm import tile_of, unit_inner_stride
from .gemv import DOT_ROWS, FLOATS, MAX_ROWS, _band_product, _block_scaled, _scale_rows, fused_scale_block
from .mxfp8 import DENSE_GROUPED_GEMM, MX_BLOCK, MXFP8_GEMM, group_tile
from .pdl import launch_options, wait_for_prior
from .target import config_for

OUTPUT_COLUMNS = {"cuda": 64, "hip": 64, "default": 32,  # BLOCK_H: output columns of wo_b per step
                  "sm_100": 32}  # at 64, 32-block FP8 wo_b against bf16 wo_a spilled with the sums read by atomics
FLUSH = 1024  # accumulator values the last program turns into output per step


@triton.jit
def _low_rank_output_kernel(a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, w2_ptr, w2_scale_ptr, acc_ptr, out_ptr,
                            tickets_ptr, M, R, K, H, stride_am, stride_ag, stride_as, stride_asg, stride_bn, stride_bs,
                            stride_w2, stride_w2s, stride_om,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            BLOCK_H: tl.constexpr, GROUP_M: tl.constexpr, MX: tl.constexpr, SCALED: tl.constexpr,
                            UPCAST: tl.constexpr, FLUSH_H: tl.constexpr, W1_BLOCK: tl.constexpr,
                            EVEN_K: tl.constexpr, W2_BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program (n, g): rows of group g's low-rank tile n, then their share of every output column.
    W1_BLOCK (0: wo_a as ``group_tile`` takes it): wo_a is E4M3 with fp32 scales of W1_BLOCK x
    W1_BLOCK blocks at ``b_scale_ptr`` (rows of ``stride_bs``), a in the output's dtype, and the
    tile is the block-FP8 GEMV's band (its rows from 0: BLOCK_M holds all M). W2_BLOCK (0: wo_b in
    the output's dtype): wo_b is E4M3 with fp32 scales of W2_BLOCK x W2_BLOCK blocks at
    ``w2_scale_ptr`` (rows of ``stride_w2s``)."""
    group = tl.program_id(1).to(tl.int64)
    pid_m, pid_n = tile_of(tl.program_id(0), M, R, BLOCK_M, BLOCK_N, GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    wait_for_prior(PDL)
    if W1_BLOCK:  # each wo_a row scaled by its own block's scales (a group's R need not fill whole blocks)
        rows = group * R + tl.minimum(rn, R - 1)  # rows past R reread the last one; their values meet no wo_b
        low = _band_product(a_ptr + group * stride_ag, a_ptr, a_ptr, tl.zeros([BLOCK_M], tl.float32),
                            b_ptr + rows[:, None] * stride_bn, _scale_rows(b_scale_ptr, rows, stride_bs, W1_BLOCK),
                            M, K, stride_am, 0, tl.arange(0, BLOCK_K), BLOCK_M, BLOCK_N, BLOCK_K,
                            EVEN_K, False, False, False, W1_BLOCK)
    else:
        low = group_tile(a_ptr + group * stride_ag, a_scale_ptr + group * stride_asg, b_ptr + group * R * stride_bn,
                         b_scale_ptr + group * R * stride_bs, rm, rn, M, R, K, stride_am, stride_as, stride_bn,
                         stride_bs, BLOCK_M, BLOCK_N, BLOCK_K, MX, SCALED, UPCAST)
    ty = out_ptr.dtype.element_ty
    low = low.to(ty)  # the first half's output, rounded as its own launch stores it
    if UPCAST:
        low = low.to(tl.float32)
    cols = group * R + rn  # wo_b's columns that this tile's low-rank values meet
    col_ok = rn < R  # columns past R reread the last one: their weights load as zero
    scale_cols = w2_scale_ptr  # a block-FP8 wo_b's scales of these columns (those past R: the last's)
    if W2_BLOCK:
        scale_cols += (group * R + tl.minimum(rn, R - 1)) // W2_BLOCK
    row_ok = rm < M
    for h0 in range(0, H, BLOCK_H):
        rh = h0 + tl.arange(0, BLOCK_H)
        w = tl.load(w2_ptr + rh[None, :].to(tl.int64) * stride_w2 + cols[:, None],
                    mask=col_ok[:, None] & (rh[None, :] < H), other=0.0)  # [BLOCK_N, BLOCK_H]
        if W2_BLOCK:  # dequantized and rounded as the block-FP8 GEMV's band rounds it
            w = _block_scaled(w, scale_cols, h0, H, BLOCK_N, BLOCK_H, W2_BLOCK, False, stride_w2s).to(ty)
        if UPCAST:
            w = w.to(tl.float32)
        part = tl.dot(low, w, input_precision="ieee")
        tl.atomic_add(acc_ptr + rm[:, None] * H + rh[None, :], part, mask=row_ok[:, None] & (rh[None, :] < H),
                      sem="relaxed")
    tl.debug_barrier()  # every thread's reductions before the release
    if tl.atomic_add(tickets_ptr, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) * tl.num_programs(1) - 1:
        tl.store(tickets_ptr, 0)
        for m in range(0, M):
            for h0 in range(0, H, FLUSH_H):
                rh = h0 + tl.arange(0, FLUSH_H)
                keep = rh < H
                # read by atomics, as the reductions were made (plain loads read zeros: see above)
                total = tl.atomic_add(acc_ptr + m * H + rh, tl.zeros([FLUSH_H], tl.float32), mask=keep,
                                      sem="acquire", scope="gpu")
                tl.store(out_ptr + m * stride_om + rh, total.to(ty), mask=keep)
                tl.store(acc_ptr + m * H + rh, tl.zeros([FLUSH_H], tl.float32), mask=keep)


def refusal(rows: int, mxfp8: bool, first: torch.Tensor, first_scale: torch.Tensor | None, second: torch.Tensor,
            second_scale: torch.Tensor | None, dtype: torch.dtype, groups: int) -> str | None:
    """Why the one launch does not serve this, or None where it does: a decode step's rows; wo_a
    [G * R, K] MXFP8 against MXFP8 activations, else in the activations' dtype or block-FP8 (E4M3,
    fp32 scales of 32 or 128 blocks); wo_b [H, G * R] in that dtype or block-FP8."""
    if not 0 < rows <= MAX_ROWS:
        return f"{rows} rows, where the one launch takes 1 to {MAX_ROWS}"
    if dtype not in FLOATS:
        return f"activations in {dtype}, not one of {FLOATS}"
    if first.dim() != 2 or first.shape[0] % groups or second.dim() != 2 or second.shape[1] != first.shape[0]:
        return f"wo_a {list(first.shape)} and wo_b {list(second.shape)} are not [{groups} * R, K] and [H, {groups} * R]"
    if fused_scale_block(second, second_scale, dtype) is None:
        return f"wo_b {second.dtype} is neither {dtype} nor E4M3 with fp32 block scales"
    if mxfp8:
        if first.dtype != torch.float8_e4m3fn or first_scale is None or first_scale.dtype != torch.uint8:
            return f"MXFP8 activations against wo_a {first.dtype}, which is not MXFP8 (E4M3 with E8M0 scales)"
    elif fused_scale_block(first, first_scale, dtype) is None:
        return f"wo_a {first.dtype} is neither {dtype} nor E4M3 with fp32 block scales"
    return None


def low_rank_output(a: torch.Tensor, a_scale: torch.Tensor | None, b: torch.Tensor, b_scale: torch.Tensor | None,
                    w2: torch.Tensor, dtype: torch.dtype, w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """a [M, G, K] (E4M3 with E8M0 scales [M, G, K/32], or unquantized in ``dtype`` with no scales),
    b [G * R, K] (MXFP8 against MXFP8 a; against unquantized a, in ``dtype`` or E4M3 with fp32 block
    scales ``b_scale``), w2 [H, G * R] in ``dtype`` (or E4M3 with fp32 block scales ``w2_scale``) ->
    [M, H] in ``dtype``: w2 times each group's a[:, g] @ b[g*R:(g+1)*R].T, that product rounded to
    ``dtype`` first."""
    scaled = a_scale is not None
    if a.dim() != 3 or b.dim() != 2 or b.shape[1] != a.shape[2] or b.shape[0] % a.shape[1]:
        raise ValueError(f"a [M, G, K] and b [G * R, K] do not fit: {list(a.shape)} and {list(b.shape)}")
    m, groups, k = a.shape
    rank = b.shape[0] // groups
    why = refusal(m, scaled, b, b_scale, w2, w2_scale, dtype, groups)
    if why is None and (a.dtype == torch.float8_e4m3fn) != scaled:
        why = f"a {a.dtype} with{'' if scaled else 'out'} scales"
    if why is not None:
        raise ValueError(f"the one launch does not serve this ({why}); run the halves apart")
    if scaled and (k % MX_BLOCK or a_scale.shape != (m, groups, k // MX_BLOCK)
                   or b_scale.shape != (groups * rank, k // MX_BLOCK)):
        raise ValueError(f"scales {list(a_scale.shape)} and {list(b_scale.shape)} do not fit a {list(a.shape)} and "
                         f"b {list(b.shape)} in blocks of {MX_BLOCK}")
    w1_block = 0 if scaled else fused_scale_block(b, b_scale, dtype)
    w2_block = fused_scale_block(w2, w2_scale, dtype)
    a, b, w2 = unit_inner_stride(a, b, w2)
    w2_scale = w2 if w2_scale is None else unit_inner_stride(w2_scale)[0]  # unread where plain
    if scaled or w1_block:
        b_scale = unit_inner_stride(b_scale)[0]
    a_scale = unit_inner_stride(a_scale)[0] if scaled else a  # unread
    b_scale = b if b_scale is None else b_scale  # unread
    hidden = w2.shape[0]
    out = torch.empty(m, hidden, dtype=dtype, device=a.device)
    cfg = config_for(MXFP8_GEMM if scaled else DENSE_GROUPED_GEMM, a.device).for_m(m)
    block_m = DOT_ROWS if w1_block else cfg.block_m  # the GEMV's band holds every row in one tile
    grid = (triton.cdiv(m, block_m) * triton.cdiv(rank, cfg.block_n), groups)
    _low_rank_output_kernel[grid](
        a, a_scale, b, b_scale, w2, w2_scale, kept_zero(m * hidden, a.device, torch.float32), out,
        arrival_counters(1, a.device), m, rank, k, hidden, a.stride(0), a.stride(1), a_scale.stride(0),
        a_scale.stride(1) if scaled else 0, b.stride(0), b_scale.stride(0), w2.stride(0), w2_scale.stride(0),
        out.stride(0), BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        BLOCK_H=config_for(OUTPUT_COLUMNS, a.device), GROUP_M=cfg.group_m, MX=MX_BLOCK, SCALED=scaled,
        UPCAST=a.device.type == "cpu", FLUSH_H=FLUSH, W1_BLOCK=w1_block, EVEN_K=k % cfg.block_k == 0,
        W2_BLOCK=w2_block, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_options(a.device))
    return out
