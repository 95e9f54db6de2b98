"""The decode GEMV on block-FP8 weights (E4M3, 128 or 32 blocks) against core/native's fp8_block
linear, which dequantizes the weight to x's dtype and multiplies unquantized x: interpreter, GPU,
and compiled for every target.

The bound is the one fp32 accumulation allows: the GEMV reproduces native's weight to the bit
(``weight_values``, which native multiplies), so its result is the exact product of x and that
weight but for its sum's order (at most K fp32 roundings) and one rounding to the output's dtype."""

from __future__ import annotations

import re

import pytest
import torch

from aot import GRID_DEPENDENCY, TARGETS, amd_scratch_and_lds, amdgcn_target, compile_asm, local_memory_ops, pdl
from test_triton_gemv import SIGNATURE as GEMV_SIGNATURE
from test_triton_gemv import CPUGemvLinear

from engine.backends.triton import linear as triton_linear
from engine.backends.triton.gemv import DOT_ROWS, GEMV, MAX_ROWS, GemvConfig, gemv, gemv_kernel, norm_gemv
from engine.backends.triton.linear import TritonLinear
from engine.backends.triton.norm import TritonNorm
from engine.backends.triton.target import pick
from engine.core.families.linear import LinearWeight, weight_values
from engine.core.native import activation as native_activation
from engine.core.native import norm as native_norm
from engine.core.native.linear import NativeLinear
from engine.core.native.quant import quantize_fp8_block

FP32_EPS = 2.0**-24
CONFIGS = (GemvConfig(16, 64, 4, 1), GemvConfig(8, 256, 4, 1))  # K steps within one 128-block, over several


def fp8_weight(n: int, k: int, block: int, device="cpu", bias_dtype=None) -> LinearWeight:
    data, scale = quantize_fp8_block(torch.randn(n, k, device=device) / k**0.5, block)
    bias = None if bias_dtype is None else torch.randn(n, dtype=bias_dtype, device=device)
    return LinearWeight(data, "fp8_block", scale, bias)


def assert_within_accumulation(got, x, weight, bias=None, slack=1.0):
    """``got`` is x @ weight.T (+ bias), computed exactly, off by at most ``slack`` K fp32 roundings
    of |x| @ |weight|.T and then rounded once to got's dtype (half an ulp)."""
    xd, wd = x.double(), weight.double()
    want = xd @ wd.T + (0.0 if bias is None else bias.double())
    accumulation = slack * x.shape[-1] * FP32_EPS * (xd.abs() @ wd.abs().T)
    info = torch.finfo(got.dtype)
    bound = accumulation + info.eps / 2 * (want.abs() + accumulation) + info.smallest_normal * info.eps
    err = (got.double() - want).abs()
    assert got.shape == want.shape and not got.isnan().any()
    assert (err <= bound).all(), f"worst excess {(err - bound).max().item():.3g} over the fp32 bound"


def check_fp8_gemv(m, n, k, block, dtype, device="cpu", bias=False, config=None):
    x = torch.randn(m, k, dtype=dtype, device=device)
    w = fp8_weight(n, k, block, device, dtype if bias else None)
    got = gemv(x, w.data, w.bias, scale=w.scale, config=config,
               out=torch.full((m, n), float("nan"), dtype=dtype, device=device))
    assert got.dtype == dtype
    assert_within_accumulation(got, x, weight_values(w, dtype), w.bias)


@pytest.mark.interpret
@pytest.mark.parametrize("block", [128, 32])
@pytest.mark.parametrize("m", range(1, MAX_ROWS + 1))
def test_fp8_gemv_interpreted(seed, m, block):
    """Every row count the GEMV takes, K steps inside a block and over several; N and K (100, 300)
    fill neither whole tiles nor whole blocks."""
    check_fp8_gemv(m, 100, 300, block, torch.float16, bias=m % 2 == 1, config=CONFIGS[m % 2])


@pytest.mark.interpret
@pytest.mark.parametrize("block", [128, 32])
@pytest.mark.parametrize("m,k", [(1, 256), (3, 300)])
def test_fp8_gemv_fp32_interpreted(seed, m, k, block):
    """x in fp32: nothing but the accumulation's order between the GEMV and native; K in whole steps too."""
    check_fp8_gemv(m, 72, k, block, torch.float32, config=CONFIGS[1])


@pytest.mark.interpret
@pytest.mark.parametrize("block", [128, 32])
@pytest.mark.parametrize("m", [1, MAX_ROWS])
def test_fp8_gate_up_silu_interpreted(seed, m, block):
    """Gate rows then up rows, each scaled by its own blocks (the up half starts mid-block, at row
    80): silu(gate) * up within each product's bound (both sides' sums) carried through, in fp32."""
    inner, k = 80, 300
    x = torch.randn(m, k)
    w = fp8_weight(2 * inner, k, block)
    got = gemv(x, w.data, silu_mul=True, scale=w.scale, config=CONFIGS[1])
    both = NativeLinear(None).apply(x, w)
    gate, up = both[:, :inner].double(), both[:, inner:].double()
    wd = weight_values(w, torch.float32).double()
    bounds = 2 * k * FP32_EPS * (x.double().abs() @ wd.abs().T)
    slope = 1.1  # the largest |silu'|
    want = native_activation.silu_and_mul(both).double()
    bound = slope * bounds[:, :inner] * up.abs() + gate.abs() * bounds[:, inner:] + 8 * FP32_EPS * want.abs()
    assert got.shape == want.shape and not got.isnan().any()
    assert ((got.double() - want).abs() <= bound).all()


@pytest.mark.interpret
@pytest.mark.parametrize("block", [128, 32])
@pytest.mark.parametrize("m,residual", [(1, True), (MAX_ROWS, False)])
def test_fp8_norm_gemv_interpreted(seed, m, residual, block):
    """The fused norm then the block-FP8 product against native's norm then native's linear: the
    norm's own sums differ in order too, so K more roundings of slack; the residual sum exact."""
    k = 300
    x, r = torch.randn(m, k), (torch.randn(m, k) if residual else None)
    g = 1 + 0.1 * torch.randn(k)
    w = fp8_weight(72, k, block)
    got, summed = norm_gemv(x, r, g, 1e-6, w.data, scale=w.scale, config=CONFIGS[0])
    h, want_sum = native_norm.add_rms_norm(x, r, g, 1e-6) if residual else (native_norm.rms_norm(x, g, 1e-6), x)
    assert_within_accumulation(got, h, weight_values(w, torch.float32), slack=4)
    assert torch.equal(summed, want_sum)


def _no_gemm(monkeypatch):
    def refused(*args, **kwargs):
        raise AssertionError("a decode row of a block-FP8 weight went to the two-launch GEMM")

    monkeypatch.setitem(triton_linear.QUANTIZED, "fp8_block", refused)
    monkeypatch.setattr(triton_linear, "fp8_block_gemm", refused)


@pytest.mark.interpret
@pytest.mark.parametrize("block", [128, 32])
@pytest.mark.parametrize("m", [1, MAX_ROWS])
def test_fp8_decode_rows_take_the_gemv_interpreted(seed, monkeypatch, m, block):
    """apply, logits, gate_up_silu and norm_linear of a block-FP8 weight at decode rows: one GEMV
    launch each (the FP8 GEMM refused), equal to the bit to the GEMV called directly."""
    _no_gemm(monkeypatch)
    k = 128
    x = torch.randn(m, k, dtype=torch.float16)
    w, wb = fp8_weight(64, k, block), fp8_weight(40, k, block, bias_dtype=torch.float16)
    g = (1 + 0.1 * torch.randn(k)).to(torch.float16)
    lin, ops = CPUGemvLinear(None), TritonNorm(None)
    assert torch.equal(lin.apply(x, wb), gemv(x, wb.data, wb.bias, scale=wb.scale))
    assert torch.equal(lin.logits(x, wb), gemv(x, wb.data, wb.bias, scale=wb.scale).float())
    assert torch.equal(lin.gate_up_silu(x, w, ops), gemv(x, w.data, silu_mul=True, scale=w.scale))
    got, summed = lin.norm_linear(x, None, g, 1e-6, w, ops, silu_mul=True)
    assert torch.equal(got, norm_gemv(x, None, g, 1e-6, w.data, silu_mul=True, scale=w.scale)[0])
    assert torch.equal(summed, x)
    assert_within_accumulation(lin.apply(x, wb), x, weight_values(wb, torch.float16), wb.bias)


@pytest.mark.interpret
def test_fp8_gemv_refuses_what_it_does_not_serve():
    w = fp8_weight(64, 128, 32)
    with pytest.raises(ValueError, match="block scales"):
        gemv(torch.randn(1, 128), w.data)
    with pytest.raises(ValueError, match="block scales"):
        gemv(torch.randn(1, 128), torch.randn(64, 128), scale=w.scale)
    with pytest.raises(ValueError, match="scale"):
        gemv(torch.randn(1, 128), w.data, scale=w.scale[:, :1])
    assert not CPUGemvLinear(None)._gemv_serves(torch.randn(MAX_ROWS + 1, 128), w)


@pytest.mark.gpu
@pytest.mark.parametrize("block", [128, 32])
@pytest.mark.parametrize("m", [1, 4, MAX_ROWS])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336), (32768, 1024), (1000, 1000)])
def test_fp8_gemv_gpu(seed, m, n, k, block):
    """Llama-8B's qkv and down, V4-Flash's q_b, a shape of partial tiles: bf16 x, the tensor cores'
    fp32 accumulation given twice the slack."""
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    w = fp8_weight(n, k, block, "cuda")
    assert_within_accumulation(TritonLinear(None).apply(x, w), x, weight_values(w, torch.bfloat16), slack=4)


SIGNATURE = dict(GEMV_SIGNATURE, w_ptr="*fp8e4nv")


@pytest.mark.aot
@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("rows,k,block,silu_mul,norm", [
    (1, 4096, 128, False, False),  # Llama-8B's qkv, o, down; V4-Flash's wq_a
    (MAX_ROWS, 4096, 128, True, False),  # Llama-8B's gate/up at batch 8
    (1, 4096, 32, True, False),  # the same at one row, DeepSeek-V4.1's 32-blocks
    (MAX_ROWS, 4096, 32, False, False),  # V4.1's 32-blocks at batch 8
    (1, 1024, 32, False, True),  # V4-Flash's q_b (K q_lora 1024) behind its fp32 q_norm
    (MAX_ROWS, 1024, 128, False, True)])
def test_fp8_gemv_compiles(target, rows, k, block, silu_mul, norm):
    """E4M3 weight rows stream in wide loads on NVIDIA (16 bytes, or 8 at one row, where the tile
    then needs no layout change before the product), their scales once a block run, in registers
    (no spills, no AMD scratch); more rows than one go to the tensor cores."""
    cfg = pick(GEMV, target).for_shape(rows, k, block)
    signature = dict(SIGNATURE, norm_ptr="*fp32") if norm else SIGNATURE
    asm = compile_asm(gemv_kernel, signature, dict(BLOCK_M=1 if rows == 1 else DOT_ROWS, BLOCK_N=cfg.block_n,
                                                   BLOCK_K=cfg.block_k, HAS_BIAS=False, SILU_MUL=silu_mul,
                                                   EVEN_K=True, NORM=norm, HAS_RESIDUAL=False,
                                                   ROUND_BEFORE_WEIGHT=False, PDL=pdl(target), SCALE_BLOCK=block),
                      target, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                      divisible_by_16=["K", "stride_xm", "stride_wn", "stride_om"], sass=target.startswith("sm_"))
    if target.startswith("sm_"):
        ptx = asm["ptx"]
        assert re.search(r"ld\.global(\.nc)?\.v4\.b32|cp\.async\.cg\.shared\.global", ptx)  # 16 bytes a load
        assert ("mma" in ptx) == (rows > 1)
        if rows == 1:  # E4M3 in 8-byte loads, in x's layout: the weight tile never changes layout
            tile = f"tensor<{cfg.block_n}x{cfg.block_k}x"
            assert re.search(r"ld\.global(\.nc)?\.v2\.b32", ptx)
            assert not [line for line in asm["ttgir"].splitlines() if "convert_layout" in line and tile in line]
        assert all(op in ptx for op in GRID_DEPENDENCY)
        assert local_memory_ops(asm["sass"]) == 0
    else:
        assert target in amdgcn_target(asm["amdgcn"])
        assert amd_scratch_and_lds(asm)[0] == 0
