"""FP8 per-token-group quantization and the block-scaled FP8 GEMM against core/native, in blocks of
128 (DeepSeek-V3, V4) and of 32 (DeepSeek-V4.1, E8M0 scales as its checkpoints store them).

Quantization must match the native reference bit for bit. The GEMM is checked two ways: on the
same quantized inputs against dequantize-then-matmul in fp32 (only summation order differs), and
end to end through ``TritonLinear`` against the native linear, which leaves x unquantized
(the gap is E4M3's rounding of the activations, a few percent).
"""

from __future__ import annotations

import re

import pytest
import torch

from engine.backends.triton.fp8_gemm import TUNING, _fp8_block_gemm_kernel, fp8_block_gemm
from engine.backends.triton.fp8_quant import QUANT, _token_group_quant_kernel, quantize_fp8_token_group
from engine.backends.triton.linear import TritonLinear
from engine.backends.triton.target import pick
from engine.core.families.linear import LinearWeight
from engine.core.models.fused_projection import FusedProjection
from engine.core.models.layers import Linear
from engine.backends.triton.norm import TritonNorm
from engine.core.native import quant
from engine.core.native.linear import NativeLinear
from engine.core.native.norm import NativeNorm, rms_norm

from aot import GRID_DEPENDENCY, TARGETS, amd_scratch_and_lds, assert_no_spills, compile_asm, local_memory_ops, pdl

FP8 = torch.float8_e4m3fn


BLOCKS = [128, 32]


def poisoned_quant_out(shape, device, group=128):
    groups = -(-shape[-1] // group)
    return (torch.full(shape, float("nan"), device=device).to(FP8),
            torch.full((*shape[:-1], groups), float("nan"), device=device))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def random_activations(shape, dtype, device="cpu"):
    """Rows of very different magnitudes, so a wrong scale per token shows."""
    spread = torch.exp(4 * torch.rand(*shape[:-1], 1, device=device) - 2)
    return (torch.randn(shape, device=device) * spread).to(dtype)


def check_quant(x: torch.Tensor, group: int = 128) -> None:
    out = poisoned_quant_out(x.shape, x.device, group)
    data, scale = quantize_fp8_token_group(x, group, out=out)
    ref_data, ref_scale = quant.quantize_fp8_token_group(x, group)
    assert data.shape == ref_data.shape and scale.shape == ref_scale.shape
    assert torch.equal(scale, ref_scale)
    assert torch.equal(data.view(torch.uint8), ref_data.view(torch.uint8))


def weight_blocks(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 data and fp32 block scales: 128-blocks as DeepSeek-V3's (amax / 448), 32-blocks as
    DeepSeek-V4.1 stores them (powers of two, E8M0) and its loader keeps them (as fp32)."""
    if block == 128:
        return quant.quantize_fp8_block(w)
    data, exponents = quant.quantize_fp8_block_e8m0(w, block)
    return data, quant.e8m0_to_float(exponents)


def dequantized_product(a, a_scale, b, b_scale, block=128) -> torch.Tensor:
    return quant.dequantize_fp8_token_group(a, a_scale, block) @ quant.dequantize_fp8_block(b, b_scale, block).T


def check_gemm(m, n, k, out_dtype, bound, device="cpu", block=128):
    a, a_scale = quant.quantize_fp8_token_group(random_activations((m, k), torch.float32, device), block)
    b, b_scale = weight_blocks(torch.randn(n, k, device=device) * 0.05, block)
    out = torch.full((m, n), float("nan"), dtype=out_dtype, device=device)
    got = fp8_block_gemm(a, a_scale, b, b_scale, out=out)
    ref = dequantized_product(a, a_scale, b, b_scale, block)
    assert got.dtype == out_dtype and got.shape == (m, n)
    assert not got.isnan().any()
    assert rel_err(got, ref) < bound


@pytest.mark.interpret
@pytest.mark.parametrize("shape", [(1, 128), (7, 300), (2, 3, 384)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_token_group_quant_matches_native(seed, shape, dtype):
    check_quant(random_activations(shape, dtype))


@pytest.mark.interpret
@pytest.mark.parametrize("shape", [(1, 32), (7, 300), (2, 3, 96)])
def test_token_group_quant_in_groups_of_32_matches_native(seed, shape):
    """DeepSeek-V4.1's activation groups: a K tail of 12 masked (300)."""
    check_quant(random_activations(shape, torch.bfloat16), 32)


@pytest.mark.interpret
def test_token_group_quant_zero_group_and_saturation(seed):
    x = random_activations((3, 256), torch.float32)
    x[1, :128] = 0  # an all-zero group: scale 1
    x[2, 5] = 1e30  # one huge value: the rest of its group rounds to (signed) zero or subnormals
    check_quant(x)


@pytest.mark.interpret
def test_every_e4m3_value_and_tie_rounds_as_torch(seed):
    """Scale 1 (every group holds 448): each E4M3 value, each midpoint (ties go to even), points a
    hair either side of them, and signed zeros and tiny values, all bit for bit as torch's cast."""
    grid = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    grid = grid[grid.isfinite() & (grid >= 0)].sort().values
    mids = (grid[1:] + grid[:-1]) / 2
    near = torch.cat([mids * (1 + 2.0**-20), mids * (1 - 2.0**-20)])
    y = torch.cat([grid, mids, near, torch.tensor([0.0, 2.0**-12, 2.0**-10, 3 * 2.0**-11])])
    y = torch.cat([y, -y])
    y = y[torch.randperm(len(y))]
    pad = (-len(y)) % 127
    y = torch.cat([y, torch.zeros(pad)]).view(-1, 127)
    x = torch.cat([torch.full((y.shape[0], 1), 448.0), y], dim=1)  # amax 448: scale exactly 1
    check_quant(x)


@pytest.mark.interpret
@pytest.mark.parametrize("m,n,k", [(1, 160, 300), (5, 96, 256), (37, 130, 200)])
@pytest.mark.parametrize("out_dtype,bound", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
@pytest.mark.parametrize("block", BLOCKS)
def test_fp8_block_gemm_matches_dequantized(seed, m, n, k, out_dtype, bound, block):
    """Edge blocks partial in N and K (160, 300; 130, 200), of 128 or of 32."""
    check_gemm(m, n, k, out_dtype, bound, block=block)


@pytest.mark.interpret
def test_fp8_block_gemm_scales_each_32_block_of_k(seed):
    """One weight block of 32 along K scaled by 2**10 and one activation group by 2**-6: a GEMM that
    applied a scale across 128 channels, or a's scale to b's group, misses by orders of magnitude."""
    m, n, k = 4, 64, 128
    a, a_scale = quant.quantize_fp8_token_group(random_activations((m, k), torch.float32), 32)
    b, b_scale = weight_blocks(torch.randn(n, k) * 0.05, 32)
    b_scale[1, 2] *= 2.0**10
    a_scale[:, 1] *= 2.0**-6
    got = fp8_block_gemm(a, a_scale, b, b_scale, torch.float32, out=torch.full((m, n), float("nan")))
    assert rel_err(got, dequantized_product(a, a_scale, b, b_scale, 32)) < 1e-5


def test_fp8_block_gemm_refuses_activations_grouped_unlike_the_weight():
    a, a_scale = quant.quantize_fp8_token_group(torch.randn(2, 256))  # groups of 128
    b, b_scale = weight_blocks(torch.randn(64, 256), 32)
    with pytest.raises(ValueError, match="groups of 32"):
        fp8_block_gemm(a, a_scale, b, b_scale)
    with pytest.raises(ValueError, match="fits no square blocks"):
        fp8_block_gemm(a, a_scale, b, b_scale[:, :3])


@pytest.mark.interpret
@pytest.mark.parametrize("lead,with_bias", [((3,), False), ((2, 9), True)])
@pytest.mark.parametrize("block", BLOCKS)
def test_triton_linear_fp8_block_matches_native(seed, lead, with_bias, block):
    x = random_activations((*lead, 256), torch.float16)
    data, scale = weight_blocks(torch.randn(192, 256) * 0.05, block)
    w = LinearWeight(data, "fp8_block", scale, torch.randn(192) if with_bias else None)
    assert w.block == block
    got = TritonLinear(None).apply(x, w)
    ref = NativeLinear(None).apply(x, w)
    assert got.shape == ref.shape and got.dtype == ref.dtype
    assert rel_err(got, ref) < 0.06  # E4M3 keeps 3 mantissa bits of x


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_linear_dense_matches_native(seed, dtype):
    x = torch.randn(4, 5, 64, dtype=dtype)
    w = LinearWeight(torch.randn(48, 64, dtype=torch.bfloat16), bias=torch.randn(48))
    got, ref = TritonLinear(None).apply(x, w), NativeLinear(None).apply(x, w)
    assert got.dtype == ref.dtype and torch.equal(got, ref)


@pytest.mark.interpret
@pytest.mark.parametrize("block", BLOCKS)
def test_fused_projection_on_triton_equals_its_parts(seed, block):
    """Two FP8 block parts as one GEMM over their concatenated weights and scales, and two dense parts
    as another, equal each part's own product; small integers keep every sum exact, so only a
    wrong row or scale offset could make them differ. In 32-blocks a third FP8 part of 128-blocks
    runs alone."""
    k, linear = 256, TritonLinear(None)
    parts = {}
    sizes = (("a", 128), ("b", 72), ("c", 256), ("d", 40)) + ((("e", 128),) if block == 32 else ())
    for name, n in sizes:
        part = parts[name] = Linear(k, n, linear, dtype=torch.float32, device="cpu")
        edge = 128 if name == "e" else block
        if n % 128 == 0:
            part.keep_quantized("fp8_block", FP8, (n // edge, k // edge))
            part.weight_scale.data.copy_(torch.exp2(torch.randint(-3, 4, (n // edge, k // edge)).float()))
        part.weight.data.copy_(torch.randint(-16, 17, (n, k)).to(part.weight.dtype))
    x = torch.randint(-4, 5, (3, k)).float()
    want = {name: part(x) for name, part in parts.items()}
    proj = FusedProjection(parts)
    proj.fuse()
    assert sorted(sorted(names) for _, names, _ in proj.groups) == [["a", "c"], ["b", "d"]] + [["e"]] * (block == 32)
    got = proj(x)
    for name, part in parts.items():  # each part, now views of the group's weight and scales, as before
        assert torch.equal(got[name], want[name]) and torch.equal(part(x), want[name]), name


def check_norm_quant(rows, k, dtype, norm_dtype, device="cpu"):
    """rms_norm(x) quantized in one launch: as the native norm then the native quantization, but
    where the row's fp32 sum of squares, taken in another order, moves a normalised value across a
    rounding boundary of x's dtype."""
    x = random_activations((rows, k), dtype, device)
    g = (1 + 0.3 * torch.randn(k, device=device)).to(norm_dtype)
    out = poisoned_quant_out(x.shape, device)
    data, scale = quantize_fp8_token_group(x, out=out, norm=(g, 1e-6))
    ref_data, ref_scale = quant.quantize_fp8_token_group(rms_norm(x, g, 1e-6))
    assert data.data_ptr() == out[0].data_ptr() and not scale.isnan().any()
    torch.testing.assert_close(scale, ref_scale, rtol=1e-2, atol=0)
    assert (data.view(torch.uint8) == ref_data.view(torch.uint8)).float().mean() > 0.99
    torch.testing.assert_close(quant.dequantize_fp8_token_group(data, scale),
                               quant.dequantize_fp8_token_group(ref_data, ref_scale), rtol=0.07, atol=1e-3)


@pytest.mark.interpret
@pytest.mark.parametrize("dtype,norm_dtype", [(torch.float16, torch.float32), (torch.float16, torch.float16),
                                              (torch.float32, torch.float32)])
def test_token_group_quant_with_the_norm_in_it_interpreted(seed, dtype, norm_dtype):
    """K of 300: a group's tail masked. Not bf16: the interpreter's fp32 -> bf16 cast truncates."""
    check_norm_quant(5, 300, dtype, norm_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8, 300])
def test_token_group_quant_with_the_norm_in_it_gpu(seed, rows):
    """DeepSeek-V4-Flash's q_norm: bf16 rows of 1024 with an fp32 weight."""
    check_norm_quant(rows, 1024, torch.bfloat16, torch.float32, "cuda")


@pytest.mark.interpret
@pytest.mark.parametrize("rows,silu_mul", [(1, False), (3, True)])
@pytest.mark.parametrize("block", BLOCKS)
def test_fp8_norm_linear_folds_the_norm_into_the_quantization(seed, monkeypatch, rows, silu_mul, block):
    """DeepSeek-V4's q_norm before a block-FP8 projection: no launch of the norm family's (it is
    refused), the result within E4M3's rounding of the native norm and linear, x returned as the sum."""
    x = random_activations((rows, 256), torch.float16)
    g = 1 + 0.3 * torch.randn(256)
    data, scale = weight_blocks(torch.randn(256, 256) * 0.05, block)
    w = LinearWeight(data, "fp8_block", scale)

    def refused(*args, **kwargs):
        raise AssertionError("the norm ran on its own")

    ops = TritonNorm(None)
    monkeypatch.setattr(ops, "rms_norm", refused)
    got, summed = TritonLinear(None).norm_linear(x, None, g, 1e-6, w, ops, silu_mul=silu_mul)
    want, _ = NativeLinear(None).norm_linear(x, None, g, 1e-6, w, NativeNorm(None), silu_mul=silu_mul)
    assert summed is x and got.shape == want.shape and got.dtype == want.dtype
    assert rel_err(got, want) < 0.06


def test_triton_linear_refuses_unknown_scheme_and_missing_scale():
    data = torch.zeros(8, 128).to(FP8)
    with pytest.raises(ValueError, match="needs its scale"):
        TritonLinear(None).apply(torch.zeros(1, 128), LinearWeight(data, "fp8_block"))
    with pytest.raises(ValueError, match="no scheme"):
        TritonLinear(None).apply(torch.zeros(1, 128), LinearWeight(data, "int4", torch.ones(1, 1)))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 7, 64, 200, 1024, 8192])
@pytest.mark.parametrize("n,k", [(2048, 2048), (8192, 2048), (2048, 8192), (4096, 7168)])
def test_fp8_block_gemm_gpu(seed, m, n, k):
    check_gemm(m, n, k, torch.bfloat16, 5e-3, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 7, 64, 200, 4096])
@pytest.mark.parametrize("n,k", [(1024, 4096), (4096, 1024), (2112, 7168)])
def test_fp8_32_block_gemm_and_linear_gpu(seed, m, n, k):
    """DeepSeek-V4.1's 32 x 32 blocks on the GPU: the GEMM against dequantize-then-matmul, activation
    groups of 32 bit for bit as the native quantization, and the linear within E4M3's rounding of x."""
    check_gemm(m, n, k, torch.bfloat16, 5e-3, device="cuda", block=32)
    x = random_activations((m, k), torch.bfloat16, "cuda")
    check_quant(x, 32)
    data, scale = weight_blocks(torch.randn(n, k, device="cuda") * 0.05, 32)
    w = LinearWeight(data, "fp8_block", scale, torch.randn(n, device="cuda"))
    assert rel_err(TritonLinear(None).apply(x, w), NativeLinear(None).apply(x, w)) < 0.06


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 100, 4096])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_quant_and_linear_gpu(seed, m, dtype):
    x = random_activations((m, 4096), dtype, "cuda")
    check_quant(x)
    data, scale = quant.quantize_fp8_block(torch.randn(2048, 4096, device="cuda") * 0.05)
    w = LinearWeight(data, "fp8_block", scale, torch.randn(2048, device="cuda"))
    got = TritonLinear(None).apply(x, w)
    ref = NativeLinear(None).apply(x, w)
    assert got.dtype == dtype and rel_err(got, ref) < 0.06


GEMM_SIGNATURE = {"a_ptr": "*fp8e4nv", "a_scale_ptr": "*fp32", "b_ptr": "*fp8e4nv", "b_scale_ptr": "*fp32",
                  "bias_ptr": "*bf16", "c_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32",
                  "stride_am": "i32", "stride_as": "i32", "stride_bn": "i32", "stride_bs": "i32", "stride_cm": "i32",
                  "stride_ag": "i32", "stride_asg": "i32"}


def compile_gemm(target: str, which: str, has_bias: bool = False, even_k: bool = True, block: int = 128,
                 sass: bool = False) -> dict[str, str]:
    """As fp8_block_gemm launches it, from the block edge's tuning table."""
    cfg = getattr(pick(TUNING[block], target), which)
    constexprs = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                      SCALE_BLOCK=block, HAS_BIAS=has_bias, EVEN_K=even_k, PDL=pdl(target), A_GROUP=block,
                      A_E8M0=False, TILE_SCALE=block % cfg.block_n == 0)
    return compile_asm(_fp8_block_gemm_kernel, GEMM_SIGNATURE, constexprs, target, num_warps=cfg.num_warps,
                       num_stages=cfg.num_stages, divisible_by_16=["K", "stride_am", "stride_bn", "stride_cm"],
                       sass=sass)


@pytest.mark.aot
@pytest.mark.parametrize("which", ["small", "large"])
def test_fp8_gemm_uses_wgmma_e4m3_on_sm90(which):
    ptx = compile_gemm("sm_90", which)["ptx"]
    assert re.search(r"wgmma\.mma_async\S*\.f32\.e4m3\.e4m3", ptx)
    assert all(op in ptx for op in GRID_DEPENDENCY)


@pytest.mark.aot
@pytest.mark.parametrize("target", ["sm_100", "gfx942", "gfx950"])
@pytest.mark.parametrize("which", ["small", "large"])
@pytest.mark.parametrize("even_k", [True, False])
def test_fp8_gemm_compiles(target, which, even_k):
    asm = compile_gemm(target, which, has_bias=True, even_k=even_k)
    assert ("ptx" if TARGETS[target].backend == "cuda" else "amdgcn") in asm


@pytest.mark.aot
@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("which", ["small", "large"])
def test_fp8_32_block_gemm_compiles_without_spills(target, which):
    """DeepSeek-V4.1's 32-blocks: K steps of 32 on the E4M3 MMA (wgmma e4m3 on sm_90), with a bias and
    a K tail, no local memory on NVIDIA, no scratch and LDS within a workgroup's on AMD."""
    asm = compile_gemm(target, which, has_bias=True, even_k=False, block=32, sass=target.startswith("sm_"))
    assert_no_spills(asm, target)
    if target == "sm_90":
        assert re.search(r"wgmma\.mma_async\S*\.f32\.e4m3\.e4m3", asm["ptx"])
        assert all(op in asm["ptx"] for op in GRID_DEPENDENCY)


@pytest.mark.aot
@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("group", [128, 32])
def test_token_group_quant_compiles(target, norm, group):
    """With and without the RMSNorm in it (an fp32 weight, as DeepSeek-V4's q_norm): no spills, no scratch."""
    cfg = pick(QUANT, target)
    signature = {"x_ptr": "*bf16", "data_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "norm_ptr": "*fp32", "T": "i32",
                 "K": "i32", "stride_x": "i32", "stride_data": "i32", "stride_scale": "i32", "eps": "fp32"}
    asm = compile_asm(_token_group_quant_kernel, signature,
                      dict(BLOCK_T=cfg.block_t, GROUP_K=group, PDL=pdl(target), NORM=norm, ROUND_BEFORE_WEIGHT=False),
                      target, num_warps=cfg.num_warps, sass=target.startswith("sm_"))
    if target.startswith("sm_"):
        assert local_memory_ops(asm["sass"]) == 0
    else:
        scratch, _ = amd_scratch_and_lds(asm)
        assert scratch == 0
    text = asm.get("ptx") or asm["amdgcn"]
    if target.startswith("sm_"):
        assert "div.rn.f32" in text  # correctly rounded, as torch divides
        assert all(op in text for op in GRID_DEPENDENCY)
