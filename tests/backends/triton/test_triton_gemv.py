"""The decode GEMV against F.linear (and the fused gate/up SiLU-and-mul against the GEMM followed by
core/native's activation): interpreter, GPU, and compiled for every target."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from aot import (GRID_DEPENDENCY, LDS_BYTES, SHARED_BYTES, TARGETS, amd_scratch_and_lds, amdgcn_target, compile_asm,
                 local_memory_ops, pdl)

from engine.backends.triton.gemv import DOT_ROWS, GEMV, MAX_ROWS, NORM_MAX_K, GemvConfig, gemv, gemv_kernel, norm_gemv
from engine.backends.triton.linear import TritonLinear
from engine.backends.triton.norm import TritonNorm
from engine.backends.triton.target import pick
from engine.core.families.linear import LinearWeight
from engine.core.native import activation as native
from engine.core.native import norm as native_norm
from engine.core.native.linear import NativeLinear
from engine.core.native.norm import NativeNorm

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _poisoned(shape, dtype, device):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def _rel(got, want):
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def check_gemv(m, n, k, dtype, device="cpu", bias=False, lead=(), config=None):
    x = torch.randn(*lead, m, k, dtype=dtype, device=device)
    w = (torch.randn(n, k, device=device) / k**0.5).to(dtype)
    b = torch.randn(n, dtype=dtype, device=device) if bias else None
    out = _poisoned((*lead, m, n), dtype, device)
    got = gemv(x, w, b, out=out, config=config)
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert got.shape == want.shape and got.dtype == dtype and not got.isnan().any()
    assert _rel(got, want) < TOL[dtype]


def check_gate_up(m, inner, k, dtype, device="cpu", config=None):
    x = torch.randn(m, k, dtype=dtype, device=device)
    w = (torch.randn(2 * inner, k, device=device) / k**0.5).to(dtype)
    got = gemv(x, w, silu_mul=True, out=_poisoned((m, inner), dtype, device), config=config)
    want = native.silu_and_mul(F.linear(x.float(), w.float()).to(dtype))  # the unfused roundings
    assert got.shape == (m, inner) and not got.isnan().any()
    assert _rel(got, want) < TOL[dtype]


def check_norm_gemv(m, n, k, dtype, device="cpu", residual=True, silu_mul=False, norm_dtype=None, config=None):
    """Against core/native's norm then the product (the unfused roundings); the residual sum exact."""
    x = torch.randn(m, k, dtype=dtype, device=device)
    r = torch.randn(m, k, dtype=dtype, device=device) if residual else None
    g = (1 + 0.1 * torch.randn(k, device=device)).to(norm_dtype or dtype)
    w = (torch.randn(2 * n if silu_mul else n, k, device=device) / k**0.5).to(dtype)
    got, summed = norm_gemv(x, r, g, 1e-6, w, silu_mul=silu_mul, config=config)
    h, want_sum = native_norm.add_rms_norm(x, r, g, 1e-6) if residual else (native_norm.rms_norm(x, g, 1e-6), x)
    want = F.linear(h.float(), w.float())
    if silu_mul:
        want = native.silu_and_mul(want.to(dtype))
    assert got.shape == (m, n) and got.dtype == dtype and not got.isnan().any()
    assert _rel(got, want) < TOL[dtype]
    assert torch.equal(summed, want_sum)


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,n,k,residual,silu_mul", [(1, 40, 300, True, False), (1, 24, 256, False, True),
                                                     (3, 33, 200, True, True), (MAX_ROWS, 16, 128, False, False)])
def test_norm_gemv_interpreted(seed, dtype, m, n, k, residual, silu_mul):
    """K in whole steps and with a tail, one row and several, with and without a residual."""
    check_norm_gemv(m, n, k, dtype, residual=residual, silu_mul=silu_mul, config=GemvConfig(16, 64, 4, 1))


@pytest.mark.interpret
def test_norm_gemv_fp32_norm_weight_interpreted(seed):
    """An fp32 norm weight multiplies before the one rounding (DeepSeek's norms)."""
    check_norm_gemv(1, 40, 256, torch.float16, norm_dtype=torch.float32)


def check_norm_rounding(m, dtype, norm_dtype, device="cpu", config=None):
    """The fused norm's row, read back through an identity weight, against core/native's: an fp32
    norm weight (DeepSeek-V4's) multiplies before the one rounding to x's dtype, one in x's dtype
    after it. Integer x keeps the fp32 sum of squares exact in any order, so the interpreter agrees
    to the bit; a GPU's approximate rsqrt may flip the odd bit."""
    k = 256
    x = torch.randint(-8, 9, (m, k), device=device).to(dtype)
    g = (1 + 0.5 * torch.randn(k, device=device)).to(norm_dtype)
    got, _ = norm_gemv(x, None, g, 1e-6, torch.eye(k, dtype=dtype, device=device), config=config)
    want = native_norm.rms_norm(x, g, 1e-6)
    assert torch.equal(got, want) if device == "cpu" else (got == want).float().mean() > 0.98


@pytest.mark.interpret
@pytest.mark.parametrize("norm_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", [1, 3])
def test_norm_gemv_rounds_as_the_norm_family_interpreted(seed, norm_dtype, m):
    """In fp16: the interpreter rounds fp32 to bf16 by truncation, the compiled kernels to nearest."""
    check_norm_rounding(m, torch.float16, norm_dtype, config=GemvConfig(16, 64, 4, 1))


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,n,k", [(1, 40, 300), (3, 64, 256), (MAX_ROWS, 33, 128), (5, 17, 64)])
def test_gemv_interpreted(seed, dtype, m, n, k):
    check_gemv(m, n, k, dtype, bias=m % 2 == 1)


@pytest.mark.interpret
def test_gemv_leading_axes_and_even_k_interpreted(seed):
    check_gemv(2, 48, 256, torch.float32, lead=(2,), config=GemvConfig(16, 128, 4, 1))  # K in whole steps
    check_gemv(2, 48, 200, torch.float32, lead=(2,), config=GemvConfig(16, 128, 4, 1))  # a K tail


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,inner,k", [(1, 24, 130), (4, 64, 256)])
def test_gate_up_silu_interpreted(seed, dtype, m, inner, k):
    check_gate_up(m, inner, k, dtype)


@pytest.mark.interpret
def test_gemv_refuses_what_it_does_not_serve():
    w = torch.randn(8, 16)
    with pytest.raises(ValueError, match="at most"):
        gemv(torch.randn(MAX_ROWS + 1, 16), w)
    with pytest.raises(ValueError, match="gate/up"):
        gemv(torch.randn(1, 16), torch.randn(7, 16), silu_mul=True)
    with pytest.raises(ValueError, match="norm weight"):
        norm_gemv(torch.randn(1, 16), None, torch.randn(15), 1e-6, w)
    with pytest.raises(ValueError, match="residual"):
        norm_gemv(torch.randn(1, 16), torch.randn(2, 16), torch.randn(16), 1e-6, w)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4, 8])
@pytest.mark.parametrize("n,k", [(4096, 1024), (1024, 3072), (151936, 1024), (6144, 4096), (4096, 14336)])
def test_gemv_gpu(seed, m, n, k):
    check_gemv(m, n, k, torch.bfloat16, device="cuda", bias=n == 4096)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8])
@pytest.mark.parametrize("inner,k", [(3072, 1024), (14336, 4096)])
def test_gate_up_silu_gpu(seed, m, inner, k):
    check_gate_up(m, inner, k, torch.bfloat16, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8])
@pytest.mark.parametrize("n,k,silu_mul", [(6144, 4096, False), (14336, 4096, True), (4096, 1024, False),
                                          (3072, 1024, True)])
@pytest.mark.parametrize("residual", [True, False])
def test_norm_gemv_gpu(seed, m, n, k, silu_mul, residual):
    check_norm_gemv(m, n, k, torch.bfloat16, device="cuda", residual=residual, silu_mul=silu_mul)


@pytest.mark.gpu
@pytest.mark.parametrize("norm_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 8])
def test_norm_gemv_rounds_as_the_norm_family_gpu(seed, norm_dtype, m):
    check_norm_rounding(m, torch.bfloat16, norm_dtype, device="cuda")


class CPUGemvLinear(TritonLinear):
    """The linear backend routing as on a GPU, its GEMV interpreted."""

    gemv_devices = ("cpu",)


@pytest.mark.interpret
@pytest.mark.parametrize("m,residual", [(1, False), (3, True), (MAX_ROWS, False)])
def test_norm_linear_keeps_the_norm_in_the_gemv_up_to_max_rows_interpreted(seed, monkeypatch, m, residual):
    """A projection fed by an RMSNorm (DeepSeek-V4's q_norm, a decoder layer's input norm) runs
    the norm in the GEMV's prologue at every row count the GEMV takes: the norm family is refused."""
    x = torch.randn(m, 96, dtype=torch.float16)
    r = torch.randn_like(x) if residual else None
    g = 1 + 0.3 * torch.randn(96)
    w = LinearWeight((torch.randn(40, 96) / 96**0.5).to(torch.float16))

    def refused(*args, **kwargs):
        raise AssertionError("the norm ran on its own")

    ops = TritonNorm(None)
    monkeypatch.setattr(ops, "rms_norm", refused)
    monkeypatch.setattr(ops, "add_rms_norm", refused)
    got, got_sum = CPUGemvLinear(None).norm_linear(x, r, g, 1e-6, w, ops)
    want, want_sum = NativeLinear(None).norm_linear(x, r, g, 1e-6, w, NativeNorm(None))
    assert _rel(got, want) < TOL[torch.float16] and torch.equal(got_sum, want_sum)


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,bias", [(1, False), (3, True)])
def test_logits_written_in_fp32_by_the_gemv_interpreted(seed, dtype, m, bias):
    """An LM head's logits: the GEMV stores its product rounded to x's dtype as fp32, equal to the
    bit to the product in x's dtype cast after it (the launch that saves), and near the native's."""
    x = torch.randn(m, 96, dtype=dtype)
    w = LinearWeight((torch.randn(72, 96) / 96**0.5).to(dtype), bias=torch.randn(72, dtype=dtype) if bias else None)
    got = CPUGemvLinear(None).logits(x, w)
    assert got.dtype == torch.float32 and got.shape == (m, 72)
    assert torch.equal(got, CPUGemvLinear(None).apply(x, w).float())  # the GEMV at one row, F.linear at more
    assert _rel(got, NativeLinear(None).logits(x, w)) < TOL[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8])
def test_logits_written_in_fp32_by_the_gemv_gpu(seed, m):
    """At Qwen3's vocabulary (151936 rows of 1024): the logits' fp32 store equals the cast after the bf16 one."""
    x = torch.randn(m, 1024, dtype=torch.bfloat16, device="cuda")
    w = LinearWeight((torch.randn(151936, 1024, device="cuda") / 32).to(torch.bfloat16))
    got = TritonLinear(None).logits(x, w)
    assert got.dtype == torch.float32 and torch.equal(got, gemv(x, w.data).float())


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, MAX_ROWS + 1, 64])
def test_triton_linear_matches_native_at_decode_rows(seed, m):
    """The backend's routing: GEMV at one row (up to MAX_ROWS behind a norm), the library GEMM past
    it, both as native computes."""
    x = torch.randn(m, 2048, dtype=torch.bfloat16, device="cuda")
    w = LinearWeight((torch.randn(2 * 1536, 2048, device="cuda") / 2048**0.5).to(torch.bfloat16),
                     bias=torch.randn(2 * 1536, dtype=torch.bfloat16, device="cuda"))
    triton_linear, native_linear = TritonLinear(None), NativeLinear(None)
    triton_norm, native_norm = TritonNorm(None), NativeNorm(None)
    assert _rel(triton_linear.apply(x, w), native_linear.apply(x, w)) < TOL[torch.bfloat16]
    plain = LinearWeight(w.data)
    assert _rel(triton_linear.gate_up_silu(x, plain, triton_norm),
                native_linear.gate_up_silu(x, plain, native_norm)) < TOL[torch.bfloat16]
    residual, g = torch.randn_like(x), (1 + 0.1 * torch.randn(2048, device="cuda")).to(torch.bfloat16)
    for weight, silu_mul in ((w, False), (plain, True)):
        got, got_sum = triton_linear.norm_linear(x, residual, g, 1e-6, weight, triton_norm, silu_mul=silu_mul)
        want, want_sum = native_linear.norm_linear(x, residual, g, 1e-6, weight, native_norm, silu_mul=silu_mul)
        assert _rel(got, want) < TOL[torch.bfloat16] and torch.equal(got_sum, want_sum)


SIGNATURE = {"x_ptr": "*bf16", "w_ptr": "*bf16", "scale_ptr": "*fp32", "bias_ptr": "*bf16", "out_ptr": "*bf16",
             "res_ptr": "*bf16", "res_out_ptr": "*bf16", "norm_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32",
             "stride_xm": "i32", "stride_wn": "i32", "stride_sn": "i32", "stride_om": "i32", "stride_rm": "i32",
             "stride_rom": "i32", "eps": "fp32"}


@pytest.mark.aot
@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("rows,silu_mul,norm", [(1, False, None), (8, True, None), (1, True, "bf16"),
                                                (8, False, "bf16"), (1, False, "fp32"), (8, False, "fp32")])
def test_gemv_compiles(target, rows, silu_mul, norm):
    """bf16 weight rows stream in 16-byte loads on NVIDIA (straight to registers, or pipelined through
    shared memory); one row stays on the CUDA cores, more go to
    the tensor cores; the fused activation uses the hardware exp2; the fused norm its rsqrt. A bf16
    norm weight is a decoder layer's input norm after a residual add; an fp32 one with no residual
    is DeepSeek-V4's q_norm before its query projections (at K 1024, the q_lora_rank)."""
    cfg = pick(GEMV, target).for_shape(rows, 1024 if norm == "fp32" else 4096)
    signature = dict(SIGNATURE, norm_ptr="*fp32") if norm == "fp32" else SIGNATURE
    asm = compile_asm(gemv_kernel, signature, dict(BLOCK_M=1 if rows == 1 else DOT_ROWS, BLOCK_N=cfg.block_n,
                                                   BLOCK_K=cfg.block_k, HAS_BIAS=not silu_mul, SILU_MUL=silu_mul,
                                                   EVEN_K=True, NORM=norm is not None, HAS_RESIDUAL=norm == "bf16",
                                                   ROUND_BEFORE_WEIGHT=norm == "bf16", PDL=pdl(target),
                                                   SCALE_BLOCK=0),
                      target, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                      divisible_by_16=["K", "stride_xm", "stride_wn", "stride_om"])
    if target.startswith("sm_"):
        ptx = asm["ptx"]
        assert re.search(r"ld\.global(\.nc)?\.v4\.b32|cp\.async\.cg\.shared\.global", ptx)  # 16 bytes a load
        assert ("mma" in ptx) == (rows > 1)
        assert ("ex2.approx" in ptx) == silu_mul
        assert ("rsqrt.approx" in ptx) == (norm is not None)
        assert all(op in ptx for op in GRID_DEPENDENCY)
    else:
        assert target in amdgcn_target(asm["amdgcn"])


@pytest.mark.aot
@pytest.mark.parametrize("target", sorted(TARGETS))
def test_fp32_rows_with_the_norm_fit_the_shared_memory(target):
    """fp32 x at eight rows (a model run in float32) with the fused norm after a residual add, at the
    longest K the norm fuses over: the tiles the launch pipelines fit one block's shared memory (LDS
    on AMD); at three stages they took 292 KiB on sm_90, over an H100's 227."""
    cfg = pick(GEMV, target).for_shape(8, NORM_MAX_K, itemsize=4)
    asm = compile_asm(gemv_kernel, {name: "*fp32" if kind == "*bf16" else kind for name, kind in SIGNATURE.items()},
                      dict(BLOCK_M=DOT_ROWS, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, HAS_BIAS=False, SILU_MUL=False,
                           EVEN_K=True, NORM=True, HAS_RESIDUAL=True, ROUND_BEFORE_WEIGHT=False, PDL=pdl(target),
                           SCALE_BLOCK=0),
                      target, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                      divisible_by_16=["K", "stride_xm", "stride_wn", "stride_om"])
    assert int(asm["shared"]) <= {**SHARED_BYTES, **LDS_BYTES}[target]


@pytest.mark.aot
@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("rows", [1, 8])
def test_logits_gemv_compiles(target, rows):
    """An LM head's GEMV (V4-Flash's hidden 4096) storing fp32 logits: the product rounded to bf16
    before the store, as the cast after a bf16 store rounded it, in registers (no spills, no scratch)."""
    cfg = pick(GEMV, target).for_shape(rows, 4096)
    asm = compile_asm(gemv_kernel, dict(SIGNATURE, out_ptr="*fp32"),
                      dict(BLOCK_M=1 if rows == 1 else DOT_ROWS, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                           HAS_BIAS=False, SILU_MUL=False, EVEN_K=True, NORM=False, HAS_RESIDUAL=False,
                           ROUND_BEFORE_WEIGHT=False, PDL=pdl(target), SCALE_BLOCK=0),
                      target, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                      divisible_by_16=["K", "stride_xm", "stride_wn", "stride_om"], sass=target.startswith("sm_"))
    if target.startswith("sm_"):
        assert re.search(r"cvt\.rn\.bf16(x2)?\.f32", asm["ptx"]) and "st.global.b32" in asm["ptx"]
        assert local_memory_ops(asm["sass"]) == 0
    else:
        assert target in amdgcn_target(asm["amdgcn"])
        assert amd_scratch_and_lds(asm)[0] == 0
