"""DeepSeek-V4's grouped output projection (wo_a) on a block-FP8 weight as stored: 32 x 32 blocks
(DeepSeek-V4.1) or 128 x 128, fed the attention's MXFP8 output (E8M0 per 32 channels) or unquantized
activations (quantized per token and the weight's block edge on the way in), against the native
definition (both dequantized, multiplied in fp32)."""

from __future__ import annotations

import pytest
import torch

from engine.backends.triton.fp8_gemm import TUNING, _fp8_block_gemm_kernel, fp8_block_grouped_gemm
from engine.backends.triton.linear import TritonLinear
from engine.backends.triton.target import pick
from engine.core.families.linear import LinearWeight, MXFP8Tensor
from engine.core.native import quant
from engine.core.native.linear import NativeLinear

from aot import TARGETS, assert_no_spills, compile_asm, pdl
from test_triton_fp8 import GEMM_SIGNATURE, random_activations, rel_err, weight_blocks


def grouped_operands(m, groups, n, k, block, device="cpu"):
    """MXFP8 activations [m, groups, k] (rows of very different magnitudes) and an FP8 weight
    [groups * n, k] in ``block``-blocks with E8M0 scales (fp32 as loaded), as V4.1 and V4 store it."""
    data, scale = quant.quantize_mxfp8(random_activations((m, groups, k), torch.float32, device))
    w_data, exponents = quant.quantize_fp8_block_e8m0(torch.randn(groups * n, k, device=device) * 0.05, block)
    return MXFP8Tensor(data, scale, torch.float32), LinearWeight(w_data, "fp8_block", quant.e8m0_to_float(exponents))


@pytest.mark.interpret
@pytest.mark.parametrize("block", [32, 128])
@pytest.mark.parametrize("m,groups,k", [(1, 2, 64), (5, 3, 160), (19, 1, 96)])
def test_grouped_fp8_block_gemm_on_mxfp8_activations(seed, block, m, groups, k):
    """Each group's columns from its own slice of x and its own rows of w (whole blocks), K tails
    masked: the native definition, to fp32 rounding; in the values' dtype through the linear family."""
    n = block if block == 128 else 2 * block
    x, w = grouped_operands(m, groups, n, k, block)
    assert w.block == block
    out = torch.full((m, groups * n), float("nan"))
    got = fp8_block_grouped_gemm(x.data, x.scale, w.data, w.scale, torch.float32, out=out)
    ref = NativeLinear(None).grouped_mxfp8(x, w)
    assert got.data_ptr() == out.data_ptr() and not got.isnan().any()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    x16 = MXFP8Tensor(x.data, x.scale, torch.bfloat16)
    got16 = TritonLinear(None).grouped_mxfp8(x16, w)
    assert got16.dtype == torch.bfloat16 and rel_err(got16, ref) < 8e-3


@pytest.mark.interpret
@pytest.mark.parametrize("block", [32, 128])
def test_grouped_fp8_block_on_unquantized_activations(seed, block):
    """bf16 activations (an attention that emits no MXFP8), strided as the attention's output is:
    quantized per token and ``block`` channels, then the grouped block GEMM; the same product as
    the native definition on the activations quantized by core/native, and within E4M3's rounding
    of the activations of the native grouped product on x as it is."""
    m, groups, n, k = 6, 3, 2 * block if block == 32 else block, 160
    x = random_activations((m, 2 * groups, k), torch.bfloat16)[:, ::2]
    data, scale = weight_blocks(torch.randn(groups * n, k) * 0.05, block)
    w = LinearWeight(data, "fp8_block", scale)
    got = TritonLinear(None).grouped(x, w)
    a, a_scale = quant.quantize_fp8_token_group(x.float(), block)
    exact = NativeLinear(None).grouped(quant.dequantize_fp8_token_group(a, a_scale, block), w)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), exact, rtol=8e-3, atol=8e-3)  # one bf16 rounding of the sum
    assert rel_err(got, NativeLinear(None).grouped(x, w)) < 0.06


@pytest.mark.interpret
def test_groups_that_share_a_block(seed):
    """A tiny model's wo_a: groups of 8 rows, four to a 32-block (and 1.5 blocks a group): each group
    reads its rows' block scales, as native does."""
    for groups, n in ((4, 8), (2, 48)):
        x, w = grouped_operands(3, groups, n, 64, 32)
        got = fp8_block_grouped_gemm(x.data, x.scale, w.data, w.scale, torch.float32)
        torch.testing.assert_close(got, NativeLinear(None).grouped_mxfp8(x, w), rtol=1e-5, atol=1e-5)


def test_grouped_fp8_block_refuses_activation_scales_that_do_not_fit():
    x, w = grouped_operands(2, 2, 32, 64, 32)
    with pytest.raises(ValueError, match="neither fp32 per 32 channels nor uint8 E8M0"):
        fp8_block_grouped_gemm(x.data, x.scale[..., :1], w.data, w.scale)  # a scale for half the channels


# DeepSeek-V4.1-Flash's wo_a: 8 groups of 64 heads x 512 / 8 = 4096 channels, rank 1024
FLASH_WO_A = dict(groups=8, n=1024, k=4096)
GROUPED_SIGNATURE = {**GEMM_SIGNATURE, "a_scale_ptr": "*u8", "stride_ag": "i32", "stride_asg": "i32"}


@pytest.mark.aot
@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("which", ["small", "large"])
@pytest.mark.parametrize("block", [32, 128])
def test_grouped_fp8_block_gemm_compiles_without_spills(target, which, block):
    """wo_a on its stored blocks fed MXFP8 (E8M0 activation scales per 32, so K steps of 32, the
    32-step tuning table) as fp8_block_grouped_gemm launches it at V4.1-Flash's shape: no local
    memory on NVIDIA, no scratch and LDS within a workgroup's on AMD, E4M3 wgmma on sm_90."""
    cfg = getattr(pick(TUNING[32], target), which)
    k = FLASH_WO_A["k"]
    constexprs = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=min(cfg.block_k, 32), GROUP_M=cfg.group_m,
                      SCALE_BLOCK=block, HAS_BIAS=False, EVEN_K=k % 32 == 0, PDL=pdl(target), A_GROUP=32, A_E8M0=True,
                      TILE_SCALE=block % cfg.block_n == 0)
    asm = compile_asm(_fp8_block_gemm_kernel, GROUPED_SIGNATURE, constexprs, target, num_warps=cfg.num_warps,
                      num_stages=cfg.num_stages, divisible_by_16=["K", "stride_am", "stride_bn", "stride_cm"],
                      sass=target.startswith("sm_"))
    assert_no_spills(asm, target)
    if target == "sm_90":
        assert "wgmma.mma_async" in asm["ptx"] and ".e4m3.e4m3" in asm["ptx"]


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 64, 2048])
@pytest.mark.parametrize("block", [32, 128])
def test_grouped_fp8_block_gemm_gpu(seed, m, block):
    """V4.1-Flash's wo_a on the compiled kernel against the native definition."""
    x, w = grouped_operands(m, FLASH_WO_A["groups"], FLASH_WO_A["n"], FLASH_WO_A["k"], block, "cuda")
    x = MXFP8Tensor(x.data, x.scale, torch.bfloat16)
    got = TritonLinear(None).grouped_mxfp8(x, w)
    assert rel_err(got, NativeLinear(None).grouped_mxfp8(x, w)) < 8e-3
