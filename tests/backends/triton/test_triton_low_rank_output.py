"""DeepSeek-V4's grouped low-rank output projection in one launch (low_rank_output.py) against
core/native's two products (``NativeLinear.low_rank_output``: the grouped product rounded to the
activations' dtype, then wo_b).

Fresh random inputs every run, outputs poisoned first (``poisoned_empty``). The one launch sums wo_b's
columns in another order (a band a program, then the programs' atomics), so it matches the native
composition to fp32 reassociation, not to the bit; the accumulator and the ticket must be left at
zero for the next launch. ``TritonLinear`` takes the launch for a decode step's rows where the GEMV
serves (on the CPU here only as a launch count configures it) and composes the halves otherwise.
wo_b block-FP8 as published (128 or 32 blocks): against the two launches on those weights (the
grouped product, then the block-FP8 GEMV) and native (which dequantizes wo_b first), to the same
reassociation.
"""

from __future__ import annotations

import pytest
import torch
from test_triton_fp8_grouped import FLASH_WO_A
from test_triton_mxfp8 import grouped_operands, random_activations

from engine.backends.triton import low_rank_output as fused
from engine.backends.triton.attention_decode import arrival_counters, kept_zero
from engine.backends.triton.gemv import DOT_ROWS, MAX_ROWS
from engine.backends.triton.linear import TritonLinear
from engine.backends.triton.mxfp8 import DENSE_GROUPED_GEMM, MXFP8_GEMM
from engine.backends.triton.target import pick
from engine.core.families.linear import LinearBackend, LinearWeight, MXFP8Tensor
from engine.core.native.linear import NativeLinear
from engine.core.native.quant import quantize_fp8_block

from aot import GRID_DEPENDENCY, LDS_BYTES, TARGETS, amd_scratch_and_lds, compile_asm, local_memory_ops, pdl

CPU = torch.device("cpu")


class GemvLinear(TritonLinear):
    """The linear backend choosing its kernels as on a GPU (the GEMV, and this launch, for a decode row)."""

    gemv_devices = ("cuda", "cpu")


def operands(m, groups, rank, k, hidden, dtype, mxfp8, block=0, first_block=0):
    """o [m, groups, k] and wo_a [groups * rank, k] (MXFP8, or dense in ``dtype``, or block-FP8 in blocks
    of ``first_block`` against o in ``dtype``), wo_b [hidden, groups * rank] (dense in ``dtype``, or
    block-FP8 in blocks of ``block``)."""
    if mxfp8:
        x, first = grouped_operands(m, groups, rank, k)
        x = MXFP8Tensor(x.data, x.scale, dtype)
    else:
        x = random_activations((m, groups, k), dtype)
        first = torch.randn(groups * rank, k) * 0.05
        if first_block:
            data, scale = quantize_fp8_block(first, first_block)
            first = LinearWeight(data, "fp8_block", scale)
        else:
            first = LinearWeight(first.to(dtype))
    second = torch.randn(hidden, groups * rank) * (groups * rank) ** -0.5
    if block:
        data, scale = quantize_fp8_block(second, block)
        return x, first, LinearWeight(data, "fp8_block", scale)
    return x, first, LinearWeight(second.to(dtype))


def at_rest(hidden_values: int) -> None:
    """The launch left its accumulator and its ticket at zero."""
    assert not kept_zero(hidden_values, CPU, torch.float32).any()
    assert arrival_counters(1, CPU)[0] == 0


@pytest.mark.interpret
@pytest.mark.parametrize("mxfp8", [True, False], ids=["mxfp8", "dense"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,groups,rank,k,hidden", [(1, 2, 48, 96, 40), (3, 3, 32, 64, 72), (8, 1, 80, 32, 16)])
def test_one_launch_equals_the_two_products(seed, poisoned_empty, mxfp8, dtype, m, groups, rank, k, hidden):
    """Ranks past a band (48 and 80 of 32) and output columns past a step (40 and 72 of 32) masked, K
    past a step (96 of 64); one to eight rows."""
    x, first, second = operands(m, groups, rank, k, hidden, dtype, mxfp8)
    got = GemvLinear(None).low_rank_output(x, first, second)
    want = NativeLinear(None).low_rank_output(x, first, second)
    assert got.dtype == dtype and got.shape == (m, hidden) and not got.isnan().any()
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-3, atol=1e-3)  # one fp16 ulp
    torch.testing.assert_close(got, want, **tol)
    at_rest(m * hidden)


@pytest.mark.interpret
@pytest.mark.parametrize("mxfp8", [True, False], ids=["mxfp8", "dense"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,groups,rank,k,hidden,block", [(1, 2, 48, 64, 136, 128), (3, 3, 40, 32, 72, 32),
                                                          (8, 1, 80, 32, 40, 32)])
def test_block_fp8_wo_b_equals_the_two_launches(seed, poisoned_empty, mxfp8, dtype, m, groups, rank, k, hidden,
                                                block):
    """wo_b in E4M3 with fp32 block scales (V4's 128, V4.1's 32): its columns G * R past a block (96 of
    128, 120 and 80 of 32, the groups' boundaries inside blocks), its rows past one (136, 72, 40); one
    to eight rows. As close to the two launches (the grouped product, the block-FP8 GEMV) and to
    native (wo_b dequantized, then the products) as the dense wo_b is."""
    x, first, second = operands(m, groups, rank, k, hidden, dtype, mxfp8, block)
    backend = GemvLinear(None)
    got = backend.low_rank_output(x, first, second)
    assert got.dtype == dtype and got.shape == (m, hidden) and not got.isnan().any()
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-3, atol=1e-3)  # one fp16 ulp
    torch.testing.assert_close(got, LinearBackend.low_rank_output(backend, x, first, second), **tol)
    torch.testing.assert_close(got, NativeLinear(None).low_rank_output(x, first, second), **tol)
    at_rest(m * hidden)


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,groups,rank,k,hidden,first_block,block", [
    (1, 2, 48, 96, 40, 32, 32), (3, 3, 40, 64, 72, 32, 0), (8, 1, 80, 160, 40, 32, 32), (2, 2, 24, 192, 24, 128, 128)])
def test_block_fp8_wo_a_equals_native_and_the_two_launches(seed, poisoned_empty, dtype, m, groups, rank, k, hidden,
                                                           first_block, block):
    """wo_a in E4M3 with fp32 block scales as V4.1 publishes it (32; 128 too), wo_b block-FP8 or dense:
    groups' rows inside blocks (48, 40 and 24 of 32 and 128), K past a step and past a block (96, 160,
    192), one to eight rows. Native dequantizes wo_a and multiplies o as it is, as the one launch does:
    within fp32 reassociation of it (one fp16 ulp). The two launches quantize o to E4M3 per token and
    block first: within that rounding (2**-4 of a value, averaged over K)."""
    x, first, second = operands(m, groups, rank, k, hidden, dtype, False, block, first_block)
    backend = GemvLinear(None)
    got = backend.low_rank_output(x, first, second)
    assert got.dtype == dtype and got.shape == (m, hidden) and not got.isnan().any()
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-3, atol=1e-3)  # one fp16 ulp
    torch.testing.assert_close(got, NativeLinear(None).low_rank_output(x, first, second), **tol)
    apart = LinearBackend.low_rank_output(backend, x, first, second)
    assert (got.float() - apart.float()).abs().max() < 2**-4 * apart.float().abs().max()
    at_rest(m * hidden)


@pytest.mark.interpret
@pytest.mark.parametrize("block,first_block", [(0, 0), (32, 0), (128, 0), (32, 32)],
                         ids=["dense", "fp8-32", "fp8-128", "v4.1-fp8-wo_a-32"])
def test_backend_takes_the_launch_for_decode_rows_only(seed, monkeypatch, block, first_block):
    """Up to MAX_ROWS rows on a device where the GEMV serves, the one launch (the grouped GEMM is never
    launched); more rows, or the interpreter's usual devices, the two products. V4.1's layout (wo_a
    and wo_b block-FP8 in 32-blocks, o unquantized) too."""
    calls = []
    launch = fused.low_rank_output
    monkeypatch.setattr(fused, "low_rank_output", lambda *a: calls.append(a[0].shape[0]) or launch(*a))
    for rows, backend, one in ((MAX_ROWS, GemvLinear(None), True), (MAX_ROWS + 1, GemvLinear(None), False),
                               (1, TritonLinear(None), False)):
        x, first, second = operands(rows, 2, 32, 64, 24, torch.float32, not first_block, block, first_block)
        calls.clear()
        got = backend.low_rank_output(x, first, second)
        assert calls == ([rows] if one else [])
        if one or not (block or first_block):  # composed, an FP8 weight past the GEMV's rows quantizes o
            torch.testing.assert_close(got, NativeLinear(None).low_rank_output(x, first, second), rtol=1e-5,
                                       atol=1e-5)


def test_refuses_what_it_does_not_fuse():
    x, first, second = operands(2, 2, 32, 64, 24, torch.float32, True)
    with pytest.raises(ValueError, match="run the halves apart"):  # a second half of another dtype
        fused.low_rank_output(x.data, x.scale, first.data, first.scale, second.data.half(), torch.float32)
    with pytest.raises(ValueError, match="do not fit"):
        fused.low_rank_output(x.data, x.scale[..., :1], first.data, first.scale, second.data, torch.float32)
    fp8 = operands(2, 2, 32, 64, 24, torch.float32, True, block=32)[2]
    for scale in (None, fp8.scale[:, :1].expand(2, 1), fp8.scale.to(torch.uint8)):  # none, no block's shape, not fp32
        assert "wo_b" in fused.refusal(2, True, first.data, first.scale, fp8.data, scale, torch.float32, 2)
        with pytest.raises(ValueError, match="run the halves apart"):
            fused.low_rank_output(x.data, x.scale, first.data, first.scale, fp8.data, torch.float32, scale)
    dense_x, block_first = operands(2, 2, 32, 64, 24, torch.float32, False, first_block=32)[:2]
    assert fused.refusal(2, False, block_first.data, block_first.scale, fp8.data, fp8.scale, torch.float32, 2) is None
    assert "rows" in fused.refusal(MAX_ROWS + 1, False, block_first.data, block_first.scale, fp8.data, fp8.scale,
                                   torch.float32, 2)
    # MXFP8 o against a block-FP8 wo_a, and unquantized o against an MXFP8 wo_a: the two launches serve them
    assert "not MXFP8" in fused.refusal(2, True, block_first.data, block_first.scale, fp8.data, fp8.scale,
                                        torch.float32, 2)
    assert "wo_a" in fused.refusal(2, False, first.data, first.scale, fp8.data, fp8.scale, torch.float32, 2)
    with pytest.raises(ValueError, match="wo_a .* run the halves apart"):
        fused.low_rank_output(dense_x, None, first.data, first.scale, fp8.data, torch.float32, fp8.scale)
    with pytest.raises(ValueError, match="fp32 block scales"):  # a block scale that is not fp32
        fused.low_rank_output(dense_x, None, block_first.data, block_first.scale.half(), fp8.data, torch.float32,
                              fp8.scale)


SIGNATURE = {"a_ptr": "*fp8e4nv", "a_scale_ptr": "*u8", "b_ptr": "*fp8e4nv", "b_scale_ptr": "*u8", "w2_ptr": "*bf16",
             "w2_scale_ptr": "*fp32", "acc_ptr": "*fp32", "out_ptr": "*bf16", "tickets_ptr": "*i32", "M": "i32",
             "R": "i32", "K": "i32", "H": "i32", "stride_am": "i32", "stride_ag": "i32", "stride_as": "i32",
             "stride_asg": "i32", "stride_bn": "i32", "stride_bs": "i32", "stride_w2": "i32", "stride_w2s": "i32",
             "stride_om": "i32"}


def compiled(signature, constexprs, cfg, target) -> dict:
    """The one launch compiled for ``target``: no spills on NVIDIA, no scratch on AMD, within the LDS;
    the reductions relaxed fp32 atomics, the arrival an acq_rel atomic at GPU scope, the sums read by
    acquiring atomics; PDL on NVIDIA."""
    cuda = TARGETS[target].backend == "cuda"
    asm = compile_asm(fused._low_rank_output_kernel, signature, {**constexprs, "PDL": pdl(target)}, target,
                      num_warps=cfg.num_warps, num_stages=cfg.num_stages, sass=cuda,
                      divisible_by_16=["K", "H", "stride_am", "stride_ag", "stride_bn", "stride_w2", "stride_om"])
    if cuda:
        ptx = asm["ptx"]
        assert "atom.global.gpu.acq_rel.add" in ptx and all(op in ptx for op in GRID_DEPENDENCY)
        assert any("red.global.gpu.relaxed.add" in line and ".f32" in line for line in ptx.splitlines())
        # the last program reads the sums by atomics (plain loads read zeros on an H100)
        assert any("atom.global.gpu.acquire.add" in line and ".f32" in line for line in ptx.splitlines())
        assert local_memory_ops(asm["sass"]) == 0
    else:
        assert "global_atomic_add_f32" in asm["amdgcn"]
        scratch, lds = amd_scratch_and_lds(asm)
        assert scratch == 0 and lds <= LDS_BYTES[target]
    return asm


@pytest.mark.aot
@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("mxfp8,w2_block", [(True, 0), (False, 0), (True, 128), (False, 32)],
                         ids=["mxfp8", "dense", "mxfp8-fp8wo_b", "dense-fp8wo_b-32"])
def test_one_launch_compiles(target, mxfp8, w2_block):
    """DeepSeek-V4-Flash's output projection at a decode step's tiles (the first half's table, wo_b in
    bf16, or block-FP8 as V4 publishes it, in 128-blocks, and V4.1 in 32), ``compiled``; the
    block-scaled MMA where the target has it (sm_100, gfx950)."""
    cfg = pick(MXFP8_GEMM if mxfp8 else DENSE_GROUPED_GEMM, target).small
    signature = SIGNATURE if mxfp8 else {**SIGNATURE, "a_ptr": "*bf16", "a_scale_ptr": "*bf16", "b_ptr": "*bf16",
                                         "b_scale_ptr": "*bf16"}
    if w2_block:
        signature = {**signature, "w2_ptr": "*fp8e4nv"}
    constexprs = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                      BLOCK_H=pick(fused.OUTPUT_COLUMNS, target), GROUP_M=cfg.group_m, MX=32, SCALED=mxfp8,
                      UPCAST=False, FLUSH_H=fused.FLUSH, W1_BLOCK=0, EVEN_K=True, W2_BLOCK=w2_block)
    asm = compiled(signature, constexprs, cfg, target)
    if mxfp8 and target == "sm_100":
        assert any("tcgen05.mma" in line and "block_scale" in line for line in asm["ptx"].splitlines())
    if mxfp8 and target == "gfx950":
        assert "v_mfma_scale_f32" in asm["amdgcn"]


@pytest.mark.aot
@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("block", [32, 128])
def test_block_fp8_wo_a_compiles(target, block):
    """DeepSeek-V4.1-Flash's output projection (wo_a and wo_b E4M3 in 32-blocks as published; 128 too)
    against bf16 o, at the tiles the launch picks for 1 and for 8 rows (the same kernel), ``compiled``."""
    k = FLASH_WO_A["k"]
    signature = {**SIGNATURE, "a_ptr": "*bf16", "a_scale_ptr": "*bf16", "b_scale_ptr": "*fp32", "w2_ptr": "*fp8e4nv"}
    tiles = {pick(DENSE_GROUPED_GEMM, target).for_m(m) for m in (1, MAX_ROWS)}
    assert len(tiles) == 1
    cfg = tiles.pop()
    compiled(signature, dict(BLOCK_M=DOT_ROWS, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                             BLOCK_H=pick(fused.OUTPUT_COLUMNS, target), GROUP_M=cfg.group_m, MX=32, SCALED=False,
                             UPCAST=False, FLUSH_H=fused.FLUSH, W1_BLOCK=block, EVEN_K=k % cfg.block_k == 0,
                             W2_BLOCK=block), cfg, target)


@pytest.mark.gpu
@pytest.mark.parametrize("mxfp8", [True, False], ids=["mxfp8", "dense"])
@pytest.mark.parametrize("m", [1, 8])
def test_one_launch_gpu(seed, mxfp8, m):
    """DeepSeek-V4-Flash's shape in bf16 on the GPU: the one launch within a bf16 ulp of the two
    products, eager and replayed from a CUDA graph on fresh inputs (the accumulator left at zero)."""
    groups, rank, k, hidden = 8, 1024, 4096, 4096
    x, first, second = operands(m, groups, rank, k, hidden, torch.bfloat16, mxfp8)
    x = MXFP8Tensor(x.data.cuda(), x.scale.cuda(), x.dtype) if mxfp8 else x.cuda()
    first = LinearWeight(first.data.cuda(), first.scheme, None if first.scale is None else first.scale.cuda())
    second = LinearWeight(second.data.cuda())
    backend, native = TritonLinear(None), NativeLinear(None)

    def check(got, run):
        oracle = native.low_rank_output(x, first, second).float()
        want = LinearBackend.low_rank_output(backend, x, first, second)  # the two launches
        torch.testing.assert_close(want.float(), oracle, rtol=2e-2, atol=2e-2,
                                   msg=lambda m: f"{run}, the two launches: {m}")
        torch.testing.assert_close(got.float(), oracle, rtol=2e-2, atol=2e-2, msg=lambda m: f"{run}, the one launch: {m}")
        torch.testing.assert_close(got.float(), want.float(), rtol=8e-3, atol=8e-3, msg=lambda m: f"{run}: {m}")
        assert not kept_zero(m * hidden, got.device, torch.float32).any(), run

    def one_launch():
        return fused.low_rank_output(x.data if mxfp8 else x, x.scale if mxfp8 else None, first.data, first.scale,
                                     second.data, torch.bfloat16)

    check(one_launch(), "eager")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = one_launch()
    for replay in range(2):
        fresh = operands(m, groups, rank, k, hidden, torch.bfloat16, mxfp8)[0]
        (x.data if mxfp8 else x).copy_(fresh.data if mxfp8 else fresh)
        if mxfp8:
            x.scale.copy_(fresh.scale)
        graph.replay()
        check(out, f"replay {replay}")
