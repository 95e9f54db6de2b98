"""MXFP8 quantization and the ``tl.dot_scaled`` GEMM against core/native.

Quantization must match the native reference bit for bit. Triton 3.9's interpreter runs
``tl.dot_scaled`` (it scales and upcasts, as sm_90 does), so the GEMM is checked there on the same
quantized inputs against dequantize-then-matmul in fp32, and through ``TritonLinear`` against the
native linear (which leaves x unquantized). The native block-scaled instructions of sm_100 and
gfx950 are checked in the compiled assembly.
"""

from __future__ import annotations

import pytest
import torch

from engine.backends.triton.linear import TritonLinear
from engine.backends.triton.mxfp8 import (DENSE_GROUPED_GEMM, MXFP8_GEMM, QUANT_BLOCKS, _mxfp8_gemm_kernel,
                                          _mxfp8_quant_kernel, grouped_gemm, mxfp8_gemm, mxfp8_grouped_gemm,
                                          quantize_mxfp8)
from engine.backends.triton.target import pick
from engine.core.families.linear import LinearWeight, MXFP8Tensor
from engine.core.native import quant
from engine.core.native.linear import NativeLinear

from aot import LDS_BYTES, TARGETS, amd_scratch_and_lds, compile_asm, local_memory_ops

FP8 = torch.float8_e4m3fn


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def random_activations(shape, dtype, device="cpu"):
    """Rows of very different magnitudes, so a wrong exponent per block shows."""
    spread = torch.exp(6 * torch.rand(*shape[:-1], 1, device=device) - 3)
    return (torch.randn(shape, device=device) * spread).to(dtype)


def check_quant(x: torch.Tensor) -> None:
    out = (torch.full(x.shape, float("nan"), device=x.device).to(FP8),
           torch.full((*x.shape[:-1], x.shape[-1] // 32), 255, dtype=torch.uint8, device=x.device))
    data, scale = quantize_mxfp8(x, out=out)
    ref_data, ref_scale = quant.quantize_mxfp8(x)
    assert data.shape == ref_data.shape and scale.shape == ref_scale.shape
    assert torch.equal(scale, ref_scale)
    assert torch.equal(data.view(torch.uint8), ref_data.view(torch.uint8))


def check_gemm(m, n, k, out_dtype, bound, device="cpu"):
    a, a_scale = quant.quantize_mxfp8(random_activations((m, k), torch.float32, device))
    b, b_scale = quant.quantize_mxfp8(torch.randn(n, k, device=device) * 0.05)
    out = torch.full((m, n), float("nan"), dtype=out_dtype, device=device)
    got = mxfp8_gemm(a, a_scale, b, b_scale, out=out)
    ref = quant.dequantize_mxfp8(a, a_scale) @ quant.dequantize_mxfp8(b, b_scale).T
    assert got.dtype == out_dtype and got.shape == (m, n)
    assert not got.isnan().any()
    assert rel_err(got, ref) < bound


@pytest.mark.interpret
@pytest.mark.parametrize("shape", [(1, 32), (7, 96), (2, 3, 256)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_mxfp8_quant_matches_native(seed, shape, dtype):
    check_quant(random_activations(shape, dtype))


@pytest.mark.interpret
def test_mxfp8_quant_edge_blocks(seed):
    x = random_activations((4, 128), torch.float32)
    x[0, :32] = 0  # all zero: the smallest exponent
    x[1, 32:64] *= 1e-39  # subnormal amax: clamped to the smallest exponent
    x[2, 64:96] *= 1e30  # large exponents
    x[3, 96] = 3e38  # near fp32's top: the largest finite exponent
    check_quant(x)


@pytest.mark.interpret
@pytest.mark.parametrize("m,n,k", [(1, 160, 96), (5, 96, 256), (37, 130, 160)])
@pytest.mark.parametrize("out_dtype,bound", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
def test_mxfp8_gemm_matches_dequantized(seed, m, n, k, out_dtype, bound):
    check_gemm(m, n, k, out_dtype, bound)


@pytest.mark.interpret
@pytest.mark.parametrize("lead,with_bias", [((3,), True), ((2, 9), False)])
def test_triton_linear_mxfp8_matches_native(seed, lead, with_bias):
    x = random_activations((*lead, 192), torch.float16)
    data, scale = quant.quantize_mxfp8(torch.randn(80, 192) * 0.05)
    w = LinearWeight(data, "mxfp8", scale, torch.randn(80) if with_bias else None)
    got = TritonLinear(None).apply(x, w)
    ref = NativeLinear(None).apply(x, w)
    assert got.shape == ref.shape and got.dtype == ref.dtype
    assert rel_err(got, ref) < 0.06  # E4M3 keeps 3 mantissa bits of x


def grouped_operands(m, groups, n, k, device="cpu"):
    """MXFP8 activations [m, groups, k] (as an attention epilogue writes them) and an mxfp8 weight
    [groups * n, k] quantized as the grouped projection keeps it (scales rounded up)."""
    data, scale = quant.quantize_mxfp8(random_activations((m, groups, k), torch.float32, device))
    w_data, w_scale = quant.quantize_fp8_block_e8m0(torch.randn(groups * n, k, device=device) * 0.05, 1, 32)
    return MXFP8Tensor(data, scale, torch.float32), LinearWeight(w_data, "mxfp8", w_scale)


@pytest.mark.interpret
@pytest.mark.parametrize("m,groups,n,k", [(1, 2, 48, 64), (5, 3, 16, 160), (37, 1, 40, 96)])
def test_mxfp8_grouped_gemm_matches_dequantized_bmm(seed, m, groups, n, k):
    """Each group's columns from its own slice of x and its own rows of w, K tails masked: the
    native definition (dequantize both, bmm in fp32), to fp32 rounding."""
    x, w = grouped_operands(m, groups, n, k)
    out = torch.full((m, groups * n), float("nan"))
    got = mxfp8_grouped_gemm(x.data, x.scale, w.data, w.scale, torch.float32, out=out)
    ref = NativeLinear(None).grouped_mxfp8(x, w)
    assert got.data_ptr() == out.data_ptr() and not got.isnan().any()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    x16 = MXFP8Tensor(x.data, x.scale, torch.float16)  # through the linear family, in the values' dtype
    got16 = TritonLinear(None).grouped_mxfp8(x16, w)
    assert got16.dtype == torch.float16 and rel_err(got16, ref) < 1e-3


@pytest.mark.interpret
@pytest.mark.parametrize("dtype,w_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                                           (torch.bfloat16, torch.float32)])
def test_dense_grouped_gemm_matches_native_bmm(seed, dtype, w_dtype):
    """The grouped output projection on unquantized weights: each group's columns from its own
    slice of x (a strided view, as the attention's output is) and its own rows of w, K tails
    masked, fp32 sums rounded once: the native bmm (which the backend keeps for a weight in
    another dtype than x's)."""
    m, groups, n, k = 5, 3, 24, 80
    x = random_activations((m, groups * 2, k), dtype)[:, ::2]
    w = LinearWeight((torch.randn(groups * n, k) * 0.05).to(w_dtype))
    out = torch.full((m, groups * n), float("nan"), dtype=dtype)
    got = grouped_gemm(x, w.data.to(dtype), out=out)
    ref = NativeLinear(None).grouped(x, w)
    assert got.data_ptr() == out.data_ptr() and got.dtype == dtype
    exact = (x.float().transpose(0, 1) @ w.data.to(dtype).float().view(groups, n, k).transpose(1, 2))
    exact = exact.transpose(0, 1).reshape(m, -1)
    tol = 1e-5 if dtype == torch.float32 else 8e-3  # one bf16 rounding of the fp32 sum
    torch.testing.assert_close(got.float(), exact, rtol=tol, atol=tol)
    torch.testing.assert_close(got, ref, rtol=2 * tol, atol=2 * tol)
    assert torch.equal(TritonLinear(None).grouped(x, w), got if dtype == w_dtype else ref)


def test_grouped_refuses_a_quantized_weight():
    x, w = grouped_operands(2, 2, 16, 32)
    with pytest.raises(ValueError, match="dense or fp8_block weight"):
        TritonLinear(None).grouped(x.dequantize(), w)  # an mxfp8 weight


def test_grouped_mxfp8_refuses_a_dense_weight():
    x, w = grouped_operands(2, 2, 16, 32)
    with pytest.raises(ValueError, match="mxfp8 or fp8_block weight"):
        TritonLinear(None).grouped_mxfp8(x, LinearWeight(quant.dequantize_mxfp8(w.data, w.scale)))


def test_mxfp8_refuses_k_not_a_multiple_of_32():
    with pytest.raises(ValueError, match="multiple of the block size"):
        quantize_mxfp8(torch.zeros(2, 48))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 7, 64, 200, 1024, 8192])
@pytest.mark.parametrize("n,k", [(2048, 2048), (8192, 2048), (2048, 8192), (4096, 7168)])
def test_mxfp8_gemm_gpu(seed, m, n, k):
    check_gemm(m, n, k, torch.bfloat16, 5e-3, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 100, 4096])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mxfp8_quant_and_linear_gpu(seed, m, dtype):
    x = random_activations((m, 4096), dtype, "cuda")
    check_quant(x)
    data, scale = quant.quantize_mxfp8(torch.randn(2048, 4096, device="cuda") * 0.05)
    w = LinearWeight(data, "mxfp8", scale, torch.randn(2048, device="cuda"))
    got = TritonLinear(None).apply(x, w)
    ref = NativeLinear(None).apply(x, w)
    assert got.dtype == dtype and rel_err(got, ref) < 0.06


GEMM_SIGNATURE = {"a_ptr": "*fp8e4nv", "a_scale_ptr": "*u8", "b_ptr": "*fp8e4nv", "b_scale_ptr": "*u8",
                  "bias_ptr": "*bf16", "c_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32",
                  "stride_am": "i32", "stride_ag": "i32", "stride_as": "i32", "stride_asg": "i32", "stride_bn": "i32",
                  "stride_bs": "i32", "stride_cm": "i32"}


def compile_gemm(target: str, which: str, has_bias: bool = False, sass: bool = False) -> dict[str, str]:
    cfg = getattr(pick(MXFP8_GEMM, target), which)
    constexprs = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                      MX=32, HAS_BIAS=has_bias, SCALED=True, UPCAST=False)
    return compile_asm(_mxfp8_gemm_kernel, GEMM_SIGNATURE, constexprs, target, num_warps=cfg.num_warps,
                       num_stages=cfg.num_stages, sass=sass,
                       divisible_by_16=["K", "stride_am", "stride_ag", "stride_as", "stride_bn", "stride_bs",
                                        "stride_cm"])


@pytest.mark.aot
@pytest.mark.parametrize("which", ["small", "large"])
def test_mxfp8_gemm_uses_block_scaled_mma_on_sm100(which):
    ptx = compile_gemm("sm_100", which)["ptx"]
    assert any("tcgen05.mma" in line and "block_scale" in line for line in ptx.splitlines())


@pytest.mark.aot
@pytest.mark.parametrize("which", ["small", "large"])
def test_mxfp8_gemm_uses_scaled_mfma_on_gfx950(which):
    """The table's gfx950 tiles (the grouped output projection's too) on the scaled MFMA, without
    scratch and within the LDS."""
    asm = compile_gemm("gfx950", which)
    assert "v_mfma_scale_f32" in asm["amdgcn"]
    scratch, lds = amd_scratch_and_lds(asm)
    assert scratch == 0 and lds <= LDS_BYTES["gfx950"]


@pytest.mark.aot
@pytest.mark.parametrize("target", ["sm_90", "gfx942"])
@pytest.mark.parametrize("which", ["small", "large"])
def test_mxfp8_gemm_compiles_emulated(target, which):
    asm = compile_gemm(target, which, has_bias=True)
    assert ("ptx" if TARGETS[target].backend == "cuda" else "amdgcn") in asm
    if target == "gfx942":  # bf16 MFMA from E4M3 scaled in registers: no scratch, within 64 KiB of LDS
        scratch, lds = amd_scratch_and_lds(asm)
        assert scratch == 0 and lds <= LDS_BYTES[target]


@pytest.mark.aot
@pytest.mark.parametrize("which", ["small", "large"])
def test_mxfp8_gemm_dequantizes_in_registers_on_sm90(which):
    """Hopper has no block-scaled MMA: the E4M3 tiles are converted and scaled in registers and a
    bf16 wgmma multiplies them (no FP8 wgmma, no dequantized copy, no spills)."""
    asm = compile_gemm("sm_90", which, sass=True)
    assert "cvt.rn.f16x2.e4m3x2" in asm["ptx"]
    wgmmas = {line.split()[0] for line in asm["ptx"].splitlines() if "wgmma.mma_async" in line}
    assert wgmmas and all(w.endswith(".bf16.bf16") for w in wgmmas)
    assert local_memory_ops(asm["sass"]) == 0


@pytest.mark.aot
@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("which", ["small", "large"])
def test_dense_grouped_gemm_compiles(target, which):
    """The unscaled grouped GEMM (bf16 wo_a) on each target's MMA, without spills or scratch and
    within the LDS."""
    cfg = getattr(pick(DENSE_GROUPED_GEMM, target), which)
    signature = {**GEMM_SIGNATURE, "a_ptr": "*bf16", "a_scale_ptr": "*bf16", "b_ptr": "*bf16", "b_scale_ptr": "*bf16"}
    constexprs = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                      MX=32, HAS_BIAS=False, SCALED=False, UPCAST=False)
    cuda = TARGETS[target].backend == "cuda"
    asm = compile_asm(_mxfp8_gemm_kernel, signature, constexprs, target, num_warps=cfg.num_warps,
                      num_stages=cfg.num_stages, sass=cuda,
                      divisible_by_16=["K", "stride_am", "stride_ag", "stride_bn", "stride_cm"])
    if cuda:
        assert ("wgmma.mma_async" if target == "sm_90" else "tcgen05.mma") in asm["ptx"]
        assert local_memory_ops(asm["sass"]) == 0
    else:
        assert "v_mfma" in asm["amdgcn"]
        scratch, lds = amd_scratch_and_lds(asm)
        assert scratch == 0 and lds <= LDS_BYTES[target]


@pytest.mark.aot
@pytest.mark.parametrize("target", sorted(TARGETS))
def test_mxfp8_quant_compiles(target):
    block_b, num_warps = pick(QUANT_BLOCKS, target)
    signature = {"x_ptr": "*bf16", "data_ptr": "*fp8e4nv", "scale_ptr": "*u8", "T": "i32", "blocks_per_row": "i32",
                 "stride_x": "i32", "stride_data": "i32", "stride_scale": "i32"}
    asm = compile_asm(_mxfp8_quant_kernel, signature, dict(BLOCK_B=block_b, MX=32), target, num_warps=num_warps,
                      divisible_by_16=["stride_x", "stride_data"])
    assert ("ptx" if TARGETS[target].backend == "cuda" else "amdgcn") in asm
