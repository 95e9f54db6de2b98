"""Reference FP8 (E4M3) quantization: DeepSeek-V3 block scales and OCP MX (MXFP8) block scales.

Kernels of every backend are checked against these, so each step is spelled out in fp32.
"""

from __future__ import annotations

import math

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite E4M3 value
FP8_EMAX = 8  # exponent of FP8_MAX's leading bit: 448 = 1.75 * 2**8
E8M0_BIAS = 127
E8M0_NAN = 255


def _quantize_blocks(x: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """2-D ``x`` in blocks of rows x cols (edge blocks partial): scale = amax / 448 per block.

    An all-zero block gets scale 1 (its data is zero either way), so no block divides by zero.
    """
    n, k = x.shape
    nb, kb = math.ceil(n / rows), math.ceil(k / cols)
    padded = x.new_zeros(nb * rows, kb * cols, dtype=torch.float32)
    padded[:n, :k] = x
    blocks = padded.view(nb, rows, kb, cols)
    amax = blocks.abs().amax(dim=(1, 3))
    # a tensor divisor: CUDA turns division by a Python scalar into a multiply by its reciprocal,
    # which can differ in the last bit; this keeps amax / 448 correctly rounded on every device
    scale = torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), torch.ones_like(amax))
    data = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return data.view(nb * rows, kb * cols)[:n, :k].contiguous(), scale


def _dequantize_blocks(data: torch.Tensor, scale: torch.Tensor, rows: int, cols: int,
                       dtype: torch.dtype) -> torch.Tensor:
    n, k = data.shape
    nb, kb = scale.shape
    if (n, k) == (nb * rows, kb * cols):  # whole blocks: each scale broadcast over its block, nothing expanded
        return (data.float().reshape(nb, rows, kb, cols) * scale[:, None, :, None]).reshape(n, k).to(dtype)
    expanded = scale.repeat_interleave(rows, dim=0)[:n].repeat_interleave(cols, dim=1)[:, :k]
    return (data.float() * expanded).to(dtype)


def quantize_fp8_block(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight [N, K] -> (E4M3 data [N, K], fp32 scale [ceil(N/block), ceil(K/block)])."""
    return _quantize_blocks(w, block, block)


def dequantize_fp8_block(data: torch.Tensor, scale: torch.Tensor, block: int = 128,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return _dequantize_blocks(data, scale, block, block, dtype)


def quantize_fp8_token_group(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations [..., K] -> (E4M3 data [..., K], fp32 scale [..., ceil(K/group)]): one scale per
    token and group of ``group`` channels, the activation side of the DeepSeek-V3 FP8 GEMM."""
    data, scale = _quantize_blocks(x.reshape(-1, x.shape[-1]), 1, group)
    return data.view(x.shape), scale.view(*x.shape[:-1], scale.shape[-1])


def dequantize_fp8_token_group(data: torch.Tensor, scale: torch.Tensor, group: int = 128,
                               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    flat = _dequantize_blocks(data.reshape(-1, data.shape[-1]), scale.reshape(-1, scale.shape[-1]), 1, group, dtype)
    return flat.view(data.shape)


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 exponents (uint8) -> fp32 2**(e - 127); 255 is NaN per the OCP MX spec."""
    e = scale.to(torch.int32)
    value = torch.ldexp(torch.ones_like(e, dtype=torch.float32), e - E8M0_BIAS)
    return torch.where(e == E8M0_NAN, torch.full_like(value, float("nan")), value)


def quantize_mxfp8(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., K] -> (E4M3 data [..., K], uint8 E8M0 scale [..., K/block]), OCP MX v1.0.

    Shared scale 2**(floor(log2(amax)) - 8): the block's largest value lands in [256, 512) and
    anything above 448 saturates. floor(log2) comes from frexp, exact for every fp32 amax. An
    all-zero block gets the smallest exponent (biased 0).
    """
    k = x.shape[-1]
    if k % block:
        raise ValueError(f"MXFP8 needs the last axis ({k}) to be a multiple of the block size {block}")
    blocks = x.float().unflatten(-1, (k // block, block))
    amax = blocks.abs().amax(dim=-1)
    _, exponent = torch.frexp(amax)  # amax = m * 2**exponent with m in [0.5, 1)
    unbiased = torch.where(amax > 0, exponent - 1 - FP8_EMAX, torch.full_like(exponent, -E8M0_BIAS))
    biased = (unbiased + E8M0_BIAS).clamp(0, E8M0_NAN - 1).to(torch.uint8)
    data = (blocks / e8m0_to_float(biased)[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return data.flatten(-2), biased


def dequantize_mxfp8(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize_mxfp8`; the block size is K / scale.shape[-1]."""
    blocks = data.float().unflatten(-1, (scale.shape[-1], -1))
    return (blocks * e8m0_to_float(scale)[..., None]).flatten(-2).to(dtype)


# DeepSeek-V4's published checkpoint layout: E8M0 (power-of-two) scales, FP8 128x128 blocks for
# the dense linears and FP4 E2M1 with one scale per 32 along K for the routed experts.

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # codes 0..7; bit 3 is the sign
FP4_MAX = 6.0
# the dedicated dtypes where this torch has them (float8_e8m0fnu since 2.7, float4_e2m1fn_x2 since 2.8)
E8M0_DTYPES = (torch.uint8, *filter(None, [getattr(torch, "float8_e8m0fnu", None)]))
FP4_PACKED_DTYPES = (torch.uint8, torch.int8, *filter(None, [getattr(torch, "float4_e2m1fn_x2", None)]))


def e8m0_exponents(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 scales stored as uint8 bytes or as ``torch.float8_e8m0fnu`` -> their uint8 bytes."""
    if scale.dtype not in E8M0_DTYPES:
        raise ValueError(f"an E8M0 scale is uint8 or float8_e8m0fnu, not {scale.dtype}")
    return scale.view(torch.uint8)


def _e8m0_ceil(ratio: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= ``ratio`` (> 0) as a biased E8M0 byte; 0 (the smallest) for ratio 0."""
    mantissa, exponent = torch.frexp(ratio)  # ratio = m * 2**exponent, m in [0.5, 1)
    unbiased = torch.where(mantissa == 0.5, exponent - 1, exponent)
    unbiased = torch.where(ratio > 0, unbiased, torch.full_like(unbiased, -E8M0_BIAS))
    return (unbiased + E8M0_BIAS).clamp(0, E8M0_NAN - 1).to(torch.uint8)


def quantize_fp8_block_e8m0(w: torch.Tensor, block: int = 128, cols: int | None = None,
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight [N, K] -> (E4M3 data [N, K], uint8 E8M0 scale [ceil(N/block), ceil(K/cols)]), blocks of
    ``block`` rows by ``cols`` (default ``block``) columns.

    DeepSeek-V4's weight format: each block's scale is amax / 448 rounded up to a power of two, so
    no element saturates and the scale is exact in E8M0. Edge blocks are partial. (V4.1's linears
    use 32 x 32 blocks, its Engram tables one scale per 32 of a row: ``block=1, cols=32``.)
    """
    cols = cols or block
    _, ratio = _quantize_blocks(w, block, cols)  # amax / 448 per block (1 for an all-zero block)
    biased = _e8m0_ceil(ratio)
    per_element = _dequantize_blocks(torch.ones_like(w, dtype=torch.float32), e8m0_to_float(biased), block, cols,
                                     torch.float32)
    return (w.float() / per_element).clamp(-FP8_MAX, FP8_MAX).to(FP8), biased


def dequantize_fp8_block_e8m0(data: torch.Tensor, scale: torch.Tensor, block: int = 128,
                              dtype: torch.dtype = torch.float32, cols: int | None = None) -> torch.Tensor:
    """E4M3 [N, K] times its E8M0 block scale [ceil(N/block), ceil(K/cols)] (uint8 or float8_e8m0fnu)."""
    return _dequantize_blocks(data, e8m0_to_float(e8m0_exponents(scale)), block, cols or block, dtype)


def _e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """fp32 (already scaled, |x| <= 6 after clamping) -> E2M1 codes 0..15, round half to even."""
    grid = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=x.device)
    a = x.abs().clamp(max=FP4_MAX)
    lower = (torch.searchsorted(grid, a.contiguous(), right=True) - 1).clamp(0, len(E2M1_VALUES) - 2)
    upper = lower + 1
    below, above = a - grid[lower], grid[upper] - a
    up = (above < below) | ((above == below) & (upper % 2 == 0))  # even code: mantissa bit 0
    magnitude = torch.where(up, upper, lower)
    return (magnitude | torch.where(x < 0, 8, 0)).to(torch.uint8)


def quantize_fp4(w: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., K] -> (packed E2M1 uint8 [..., K/2], uint8 E8M0 scale [..., K/block]).

    DeepSeek-V4's expert format (as MXFP4): per block of 32 along K the scale is amax / 6 rounded up
    to a power of two, elements round to the nearest E2M1 value (ties to even). Two codes per byte,
    element 2j in the low nibble and 2j+1 in the high one.
    """
    k = w.shape[-1]
    if k % block or block % 2:
        raise ValueError(f"FP4 needs the last axis ({k}) to be a multiple of the (even) block size {block}")
    blocks = w.float().unflatten(-1, (k // block, block))
    amax = blocks.abs().amax(dim=-1)
    biased = _e8m0_ceil(amax / torch.full_like(amax, FP4_MAX))
    codes = _e2m1_codes(blocks / e8m0_to_float(biased)[..., None]).flatten(-2)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), biased


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Packed E2M1 (uint8, int8 or float4_e2m1fn_x2) [..., K/2] -> fp32 [..., K], low nibble first."""
    if packed.dtype not in FP4_PACKED_DTYPES:
        raise ValueError(f"packed FP4 is uint8, int8 or float4_e2m1fn_x2, not {packed.dtype}")
    grid = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    table = torch.cat([grid, -grid])
    u8 = packed.contiguous().view(torch.uint8).long()
    return torch.stack([table[u8 & 0xF], table[u8 >> 4]], dim=-1).flatten(-2)


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize_fp4`: packed [..., K/2] and E8M0 scale [..., K/block] -> [..., K];
    the block size is K / scale.shape[-1]."""
    values = unpack_fp4(packed)
    blocks = values.unflatten(-1, (scale.shape[-1], -1))
    return (blocks * e8m0_to_float(e8m0_exponents(scale))[..., None]).flatten(-2).to(dtype)
