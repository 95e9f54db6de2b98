"""RMSNorm kernels against core/native/norm.py: interpreter, GPU, and compiled for every target."""

from __future__ import annotations

import pytest
import torch

from aot import GRID_DEPENDENCY, TARGETS, amdgcn_target, compile_asm, pdl

from engine.backends.triton.norm import add_rms_norm, rms_norm, rms_norm_kernel
from engine.core.native import norm as native

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3),
       torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}


def _inputs(tokens, hidden, dtype, weight_dtype, device):
    x = torch.randn(tokens, hidden, dtype=dtype, device=device) * 3
    residual = torch.randn(tokens, hidden, dtype=dtype, device=device)
    weight = (1 + 0.5 * torch.randn(hidden, device=device)).to(weight_dtype)
    return x, residual, weight


def _poisoned(like: torch.Tensor) -> torch.Tensor:
    return torch.full_like(like, float("nan"))


def _check_rms_norm(x, weight, eps):
    out = rms_norm(x, weight, eps, out=_poisoned(x))
    want = native.rms_norm(x, weight, eps)
    torch.testing.assert_close(out, want, **TOL[x.dtype])
    _check_rounding_order(out, want)


def _check_rounding_order(out, want):
    """Same rounding steps as the oracle: in 16-bit dtypes only a different fp32 sum of squares can
    flip a bit (fp32 results differ in the last bits everywhere)."""
    if out.dtype != torch.float32:
        assert (out == want).float().mean() > 0.98


def _check_add_rms_norm(x, residual, weight, eps):
    out, summed = add_rms_norm(x, residual, weight, eps, out=_poisoned(x), residual_out=_poisoned(x))
    want_out, want_summed = native.add_rms_norm(x, residual, weight, eps)
    torch.testing.assert_close(summed, want_summed, rtol=0, atol=0)
    torch.testing.assert_close(out, want_out, **TOL[x.dtype])
    _check_rounding_order(out, want_out)


@pytest.mark.interpret
@pytest.mark.parametrize("dtype,weight_dtype", [(torch.float32, torch.float32), (torch.float16, torch.float16),
                                                (torch.float16, torch.float32)])
@pytest.mark.parametrize("hidden", [64, 100])
def test_rms_norm_interpreted(seed, dtype, weight_dtype, hidden):
    x, _, weight = _inputs(7, hidden, dtype, weight_dtype, "cpu")
    _check_rms_norm(x, weight, 1e-6)


@pytest.mark.interpret
@pytest.mark.parametrize("dtype,weight_dtype", [(torch.float32, torch.float32), (torch.float16, torch.float16),
                                                (torch.float16, torch.float32)])
def test_add_rms_norm_interpreted(seed, dtype, weight_dtype):
    x, _, weight = _inputs(5, 96, dtype, weight_dtype, "cpu")
    residual = torch.randn(5, 2, 96, dtype=dtype)[:, 1]  # rows with a stride of their own
    _check_add_rms_norm(x, residual, weight, 1e-5)


@pytest.mark.interpret
def test_rms_norm_strided_rows_interpreted(seed):
    """Rows of a wider tensor (a slice of a fused projection) are read in place."""
    wide = torch.randn(6, 3, 64)
    weight = torch.randn(64)
    _check_rms_norm(wide[:, 1], weight, 1e-6)


@pytest.mark.interpret
def test_add_rms_norm_in_place_interpreted(seed):
    x, residual, weight = _inputs(4, 64, torch.float16, torch.float16, "cpu")
    want_out, want_summed = native.add_rms_norm(x, residual, weight, 1e-6)
    out, summed = add_rms_norm(x, residual, weight, 1e-6, out=x, residual_out=residual)
    assert out.data_ptr() == x.data_ptr() and summed.data_ptr() == residual.data_ptr()
    torch.testing.assert_close(summed, want_summed, rtol=0, atol=0)
    torch.testing.assert_close(out, want_out, **TOL[torch.float16])


@pytest.mark.gpu
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens,hidden", [(8192, 4096), (1, 4096), (33, 7168), (256, 8192)])
def test_rms_norm_gpu(seed, weight_dtype, tokens, hidden):
    x, residual, weight = _inputs(tokens, hidden, torch.bfloat16, weight_dtype, "cuda")
    _check_rms_norm(x, weight, 1e-6)
    _check_add_rms_norm(x, residual, weight, 1e-6)


SIGNATURE = {"x_ptr": "*bf16", "residual_ptr": "*bf16", "weight_ptr": "*bf16", "out_ptr": "*bf16",
             "residual_out_ptr": "*bf16", "stride_x": "i32", "stride_r": "i32", "stride_o": "i32",
             "stride_ro": "i32", "hidden": "i32", "eps": "fp32"}
ALIGNED = ["stride_x", "stride_r", "stride_o", "stride_ro", "hidden"]  # as the JIT specializes 4096


@pytest.mark.aot
@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("has_residual", [False, True])
def test_rms_norm_compiles(target, has_residual):
    """Hidden 4096 in bf16: 16-byte loads and stores, a hardware reciprocal square root."""
    asm = compile_asm(rms_norm_kernel, SIGNATURE,
                      {"HAS_RESIDUAL": has_residual, "ROUND_BEFORE_WEIGHT": True, "BLOCK": 4096, "PDL": pdl(target)},
                      target, num_warps=16 if target.startswith("sm_") else 8, divisible_by_16=ALIGNED)
    if target.startswith("sm_"):
        ptx = asm["ptx"]
        assert f".target {target}a" in ptx
        assert "ld.global.v4.b32" in ptx and "st.global.v4.b32" in ptx
        assert "rsqrt.approx" in ptx
        assert all(op in ptx for op in GRID_DEPENDENCY)
    else:
        gcn = asm["amdgcn"]
        assert target in amdgcn_target(gcn)
        assert "load_dwordx4" in gcn and "store_dwordx4" in gcn
        assert "v_rsq_f32" in gcn
