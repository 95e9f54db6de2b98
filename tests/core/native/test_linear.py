"""Native linear: dense, FP8 block and MXFP8 weights against a matmul on the dequantized weight."""

from __future__ import annotations

import pytest
import torch

from engine.core.families.linear import LinearWeight
from engine.core.native.linear import NativeLinear
from engine.core.native.quant import quantize_fp8_block, quantize_mxfp8

linear = NativeLinear(ctx=None)


def fp8_block_weight(n, k, block=128):
    """A weight whose FP8 block quantization is exact: E4M3 codes times a power-of-two block scale."""
    codes = torch.randint(0, 126, (n, k), dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    codes = codes * torch.where(torch.rand(n, k) < 0.5, -1.0, 1.0)
    codes[::block, ::block] = 448.0
    scale = 2.0 ** torch.randint(-8, -4, (-(-n // block), -(-k // block))).float()
    dense = codes * scale.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    return dense, scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_dense(seed, dtype, bias):
    x, w = torch.randn(3, 5, 64).to(dtype), torch.randn(48, 64).to(dtype)
    b = torch.randn(48).to(dtype) if bias else None
    out = linear.apply(x, LinearWeight(w, bias=b))
    assert out.dtype == dtype and out.shape == (3, 5, 48)
    expected = x.float() @ w.float().T + (b.float() if bias else 0)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("shape", [(256, 384), (200, 130)])
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_block(seed, shape, bias):
    dense, _ = fp8_block_weight(*shape)
    data, scale = quantize_fp8_block(dense)
    b = torch.randn(shape[0]) if bias else None
    x = torch.randn(7, shape[1])
    out = linear.apply(x, LinearWeight(data, scheme="fp8_block", scale=scale, bias=b))
    torch.testing.assert_close(out, x @ dense.T + (b if bias else 0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp8(seed, dtype):
    w = torch.randn(96, 160)
    data, scale = quantize_mxfp8(w)
    dequantized = data.float().view(96, 5, 32) * 2.0 ** (scale.float() - 127)[..., None]
    x = torch.randn(4, 160).to(dtype)
    out = linear.apply(x, LinearWeight(data, scheme="mxfp8", scale=scale))
    assert out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), x.float() @ dequantized.view(96, 160).T, rtol=tol, atol=tol)


def test_unknown_scheme_and_missing_scale():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="no scheme"):
        linear.apply(x, LinearWeight(torch.randn(4, 8), scheme="int4", scale=torch.ones(1)))
    with pytest.raises(ValueError, match="needs its scale"):
        linear.apply(x, LinearWeight(torch.randn(4, 8).to(torch.float8_e4m3fn), scheme="fp8_block"))
