"""FP8 block and MXFP8 reference quantization: error bounds, exactness, scales, shapes."""

from __future__ import annotations

import math

import pytest
import torch

from engine.core.native.quant import (FP8, FP8_MAX, dequantize_fp8_block, dequantize_fp8_token_group,
                                      dequantize_mxfp8, e8m0_to_float, quantize_fp8_block,
                                      quantize_fp8_token_group, quantize_mxfp8)

E4M3_REL = 2**-4  # half an ulp of a 3-bit mantissa
E4M3_SUBNORMAL_STEP = 2**-9


def block_amax(x, rows, cols):
    """Per-element amax of its block, by explicit loops over blocks."""
    out = torch.empty_like(x, dtype=torch.float32)
    for r in range(0, x.shape[0], rows):
        for c in range(0, x.shape[1], cols):
            out[r:r + rows, c:c + cols] = x[r:r + rows, c:c + cols].abs().max()
    return out


def representable(n, m):
    """Random finite E4M3 values."""
    codes = torch.randint(0, 256, (n, m), dtype=torch.uint8).view(FP8).float()
    return torch.where(codes.isnan(), torch.zeros_like(codes), codes)


@pytest.mark.parametrize("shape", [(128, 128), (256, 384), (130, 200), (1, 7), (300, 129)])
def test_fp8_block_round_trip(seed, shape):
    w = torch.randn(shape) * torch.rand(shape[0], 1) * 10
    data, scale = quantize_fp8_block(w)
    assert data.dtype == FP8 and data.shape == w.shape
    assert scale.dtype == torch.float32 and scale.shape == (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))
    amax = block_amax(w, 128, 128)
    torch.testing.assert_close(scale.repeat_interleave(128, 0)[: shape[0]].repeat_interleave(128, 1)[:, : shape[1]],
                               amax / FP8_MAX)
    back = dequantize_fp8_block(data, scale)
    err = (back - w).abs()
    assert (err <= amax * 2**-3).all()
    assert (err <= E4M3_REL * w.abs() + E4M3_SUBNORMAL_STEP * amax / FP8_MAX * 1.001).all()
    # the largest value of each block maps to the largest E4M3 value
    at_max = w.abs() == amax
    assert (data.float().abs()[at_max] == FP8_MAX).all()


def test_fp8_block_exact_for_representable(seed):
    """Values that are E4M3 numbers times a power-of-two block scale, with 448 in each block, survive."""
    codes = representable(256, 256)
    codes[::128, ::128] = FP8_MAX
    powers = 2.0 ** torch.randint(-10, 10, (2, 2)).float()
    w = codes * powers.repeat_interleave(128, 0).repeat_interleave(128, 1)
    data, scale = quantize_fp8_block(w)
    torch.testing.assert_close(scale, powers, rtol=0, atol=0)
    torch.testing.assert_close(dequantize_fp8_block(data, scale), w, rtol=0, atol=0)


def test_fp8_block_zero_block_and_dtype(seed):
    w = torch.randn(256, 256)
    w[:128, 128:] = 0
    data, scale = quantize_fp8_block(w.bfloat16())
    assert torch.isfinite(scale).all() and (scale > 0).all()
    back = dequantize_fp8_block(data, scale, dtype=torch.bfloat16)
    assert back.dtype == torch.bfloat16 and (back[:128, 128:] == 0).all()


@pytest.mark.parametrize("shape", [(5, 128), (3, 300), (2, 4, 256), (1, 1)])
def test_fp8_token_group_round_trip(seed, shape):
    x = torch.randn(shape) * 5
    data, scale = quantize_fp8_token_group(x)
    assert data.shape == x.shape and scale.shape == (*shape[:-1], math.ceil(shape[-1] / 128))
    flat = x.reshape(-1, shape[-1])
    amax = block_amax(flat, 1, 128).view(shape)
    torch.testing.assert_close(scale.reshape(-1, scale.shape[-1]).repeat_interleave(128, 1)[:, : shape[-1]],
                               (amax / FP8_MAX).reshape(-1, shape[-1]))
    back = dequantize_fp8_token_group(data, scale)
    err = (back - x).abs()
    assert (err <= E4M3_REL * x.abs() + E4M3_SUBNORMAL_STEP * amax / FP8_MAX * 1.001).all()


def test_token_group_is_block_with_one_row(seed):
    x = torch.randn(6, 256)
    data, scale = quantize_fp8_token_group(x)
    ref = [quantize_fp8_block(x[i:i + 1]) for i in range(6)]
    assert torch.equal(data.view(torch.uint8), torch.cat([d for d, _ in ref]).view(torch.uint8))
    assert torch.equal(scale, torch.cat([s for _, s in ref]))


def test_e8m0_decoding():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    values = e8m0_to_float(codes)
    assert values.dtype == torch.float32
    expected = torch.tensor([math.ldexp(1.0, e - 127) for e in range(255)], dtype=torch.float32)
    torch.testing.assert_close(values[:255], expected, rtol=0, atol=0)
    assert values[255].isnan()


@pytest.mark.parametrize("shape", [(4, 64), (3, 5, 96), (32,)])
def test_mxfp8_round_trip(seed, shape):
    x = torch.randn(shape) * torch.exp(torch.randn(shape) * 3)
    data, scale = quantize_mxfp8(x)
    assert data.dtype == FP8 and data.shape == x.shape
    assert scale.dtype == torch.uint8 and scale.shape == (*shape[:-1], shape[-1] // 32)
    blocks = x.unflatten(-1, (-1, 32))
    amax = blocks.abs().amax(-1)
    expected_exp = torch.floor(torch.log2(amax.double())).long() - 8 + 127
    torch.testing.assert_close(scale.long(), expected_exp.clamp(0, 254), rtol=0, atol=0)
    shared = e8m0_to_float(scale)
    assert torch.equal(shared, torch.exp2(torch.round(torch.log2(shared))))  # powers of two
    back = dequantize_mxfp8(data, scale)
    err = (back - x).unflatten(-1, (-1, 32)).abs()
    assert (err <= amax[..., None] * 2**-3).all()
    # below the saturation point the usual E4M3 rounding bound holds
    unsat = blocks.abs() < FP8_MAX * shared[..., None]
    bound = E4M3_REL * blocks.abs() + E4M3_SUBNORMAL_STEP * shared[..., None]
    assert (err[unsat] <= bound[unsat]).all()
    # values above 448 * scale saturate to +-448
    sat = ~unsat
    assert (data.float().unflatten(-1, (-1, 32))[sat].abs() == FP8_MAX).all()


def test_mxfp8_exact_for_representable(seed):
    codes = representable(8, 128)
    codes[:, ::32] = torch.tensor([256.0, -288.0, 448.0, -320.0]).repeat(8, 1)  # a leading bit of 2**8 per block
    powers = 2.0 ** torch.randint(-20, 20, (8, 4)).float()
    x = codes * powers.repeat_interleave(32, 1)
    data, scale = quantize_mxfp8(x)
    torch.testing.assert_close(e8m0_to_float(scale), powers, rtol=0, atol=0)
    torch.testing.assert_close(dequantize_mxfp8(data, scale), x, rtol=0, atol=0)


def test_mxfp8_zero_block_and_tiny_values(seed):
    x = torch.randn(2, 96)
    x[0, :32] = 0
    x[1, 32:64] *= 1e-40  # subnormal fp32: the exponent clamps at the smallest scale
    data, scale = quantize_mxfp8(x)
    assert scale[0, 0] == 0 and (data[0, :32].float() == 0).all()
    back = dequantize_mxfp8(data, scale, dtype=torch.bfloat16)
    assert back.dtype == torch.bfloat16 and torch.isfinite(back.float()).all()
    assert (back[0, :32] == 0).all()


def test_mxfp8_rejects_ragged_blocks():
    with pytest.raises(ValueError, match="multiple of the block"):
        quantize_mxfp8(torch.randn(3, 40))


@pytest.mark.gpu
def test_cuda_matches_cpu(seed):
    w = torch.randn(200, 300)
    for quant in (quantize_fp8_block, quantize_fp8_token_group):
        d, s = quant(w)
        cd, cs = quant(w.cuda())
        assert torch.equal(cd.cpu().view(torch.uint8), d.view(torch.uint8)) and torch.equal(cs.cpu(), s)
    x = torch.randn(7, 320) * 100
    d, s = quantize_mxfp8(x)
    cd, cs = quantize_mxfp8(x.cuda())
    assert torch.equal(cd.cpu().view(torch.uint8), d.view(torch.uint8)) and torch.equal(cs.cpu(), s)
    torch.testing.assert_close(dequantize_mxfp8(cd, cs).cpu(), dequantize_mxfp8(d, s), rtol=0, atol=0)
