"""SiLU-and-mul against core/native/activation.py: interpreter, GPU, and compiled for every target."""

from __future__ import annotations

import pytest
import torch

from aot import GRID_DEPENDENCY, TARGETS, amdgcn_target, compile_asm, pdl

from engine.backends.triton.activation import silu_and_mul, silu_and_mul_kernel
from engine.core.native import activation as native

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3),
       torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}


def _check(x):
    inner = x.shape[-1] // 2
    out = silu_and_mul(x, out=torch.full((*x.shape[:-1], inner), float("nan"), dtype=x.dtype, device=x.device))
    want = native.silu_and_mul(x)
    torch.testing.assert_close(out, want, **TOL[x.dtype])
    if x.dtype != torch.float32:  # the same two roundings as the oracle: almost every bit agrees
        assert (out == want).float().mean() > 0.98


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(5, 2 * 64), (2, 3, 2 * 300), (1, 2 * 7)])
def test_silu_and_mul_interpreted(seed, dtype, shape):
    _check(torch.randn(shape, dtype=dtype) * 4)


@pytest.mark.interpret
def test_silu_and_mul_strided_rows_interpreted(seed):
    wide = torch.randn(6, 3 * 128, dtype=torch.float16)
    _check(wide[:, : 2 * 128])


@pytest.mark.gpu
@pytest.mark.parametrize("tokens,inner", [(8192, 14336), (1, 14336), (37, 768), (4096, 18944)])
def test_silu_and_mul_gpu(seed, tokens, inner):
    _check(torch.randn(tokens, 2 * inner, dtype=torch.bfloat16, device="cuda") * 4)


@pytest.mark.aot
@pytest.mark.parametrize("target", sorted(TARGETS))
def test_silu_and_mul_compiles(target):
    """bf16 at I = 14336: 16-byte loads and stores and the hardware exp2."""
    asm = compile_asm(silu_and_mul_kernel, {"x_ptr": "*bf16", "out_ptr": "*bf16", "stride_x": "i32",
                                            "stride_o": "i32", "inner": "i32"},
                      {"BLOCK": 1024 if target.startswith("sm_") else 2048, "PDL": pdl(target)}, target,
                      divisible_by_16=["stride_x", "stride_o", "inner"])
    if target.startswith("sm_"):
        ptx = asm["ptx"]
        assert f".target {target}a" in ptx
        assert "ld.global.v4.b32" in ptx and "st.global.v4.b32" in ptx
        assert "ex2.approx" in ptx
        assert all(op in ptx for op in GRID_DEPENDENCY)
    else:
        gcn = asm["amdgcn"]
        assert target in amdgcn_target(gcn)
        assert "load_dwordx4" in gcn and "store_dwordx4" in gcn
        assert "v_exp_f32" in gcn
