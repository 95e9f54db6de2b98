"""FP4 weight rows unpacked in registers, for the targets whose matrix units take no E2M1 operand.

The rows are packed E2M1 (two codes a byte, element 2j in the low nibble) with one E8M0 scale per
32 along K. The fused MoE multiplies such a tile as the first operand of its dot: on sm_90 that
operand can stay in registers (wgmma reads only the second one from shared memory), so the unpacked
weights never pass through shared memory. What bounds such a kernel is the arithmetic of
unpacking: at the copy bandwidth an SM must unpack about 40 weights a cycle, so a few instructions
each is the budget.

``fp4_rows_ptx`` (CUDA, bf16) spends about three: eight codes a 32-bit word through shifts and
masks straight into bf16 bit patterns, two codes a register, then two packed bf16 multiplies. A
code's three value bits land on bf16's two lowest exponent bits and its top mantissa bit, so the
pattern reads the code's value times 2**-126 (code 1 becomes bf16's subnormal 2**-127, as E2M1's
own subnormal 0.5 is): times 2**126, then times the scale, both powers of two, the value is exact.
``fp4_rows`` does the same with portable operations (fp16 patterns, fp32 scaling) for the
interpreter, AMD and fp32/fp16 activations.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .fp8_quant import e8m0_to_float

# Per 32-bit word of packed bytes b0..b3 (codes k0..k7, k_2i in b_i's low nibble), four registers of
# two bf16 each, [k0, k1], [k2, k3] (the first output's four values), [k4, k5], [k6, k7] (the
# second's). The low nibbles (lo) and the high ones (hi) are split into bytes; a byte permute puts
# a code pair's nibbles in bytes 0 and 2 (selector 8 reads a zero: the sign of a nibble's byte);
# one multiply by 2**6 + 2**12 copies each nibble to its value bits (6-8) and its sign bit (15)
# without overlap, and a mask keeps those.
_UNPACK = tl.constexpr("""
{
.reg .b32 lo, hi, t, b;
mov.b32 b, 0x7E807E80;
and.b32 lo, $4, 0x0F0F0F0F;
shr.b32 hi, $4, 4;
and.b32 hi, hi, 0x0F0F0F0F;
prmt.b32 t, lo, hi, 0x8480; mul.lo.u32 t, t, 0x1040; and.b32 $0, t, 0x81C081C0;
prmt.b32 t, lo, hi, 0x8581; mul.lo.u32 t, t, 0x1040; and.b32 $1, t, 0x81C081C0;
prmt.b32 t, lo, hi, 0x8682; mul.lo.u32 t, t, 0x1040; and.b32 $2, t, 0x81C081C0;
prmt.b32 t, lo, hi, 0x8783; mul.lo.u32 t, t, 0x1040; and.b32 $3, t, 0x81C081C0;
mul.rn.bf16x2 $0, $0, b; mul.rn.bf16x2 $0, $0, $5;
mul.rn.bf16x2 $1, $1, b; mul.rn.bf16x2 $1, $1, $5;
mul.rn.bf16x2 $2, $2, b; mul.rn.bf16x2 $2, $2, $5;
mul.rn.bf16x2 $3, $3, b; mul.rn.bf16x2 $3, $3, $5;
}
""")


@triton.jit
def _e8m0_to_bf16(scale):
    """E8M0 exponents (uint8) -> 2**(e - 127) in bf16, exact (0 is bf16's subnormal 2**-127)."""
    e = scale.to(tl.int16)
    return tl.where(e == 0, 0x40, e << 7).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def fp4_rows_ptx(packed, scale, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Packed E2M1 [BLOCK_N, BLOCK_K/2] and E8M0 [BLOCK_N, BLOCK_K/32] -> bf16 [BLOCK_N, BLOCK_K]."""
    groups: tl.constexpr = BLOCK_K // 32
    codes = packed.reshape(BLOCK_N, groups, 16)
    scales = tl.broadcast_to(_e8m0_to_bf16(scale).reshape(BLOCK_N, groups, 1), (BLOCK_N, groups, 16))
    first, second = tl.inline_asm_elementwise(_UNPACK, "=r,=r,=r,=r,r,r,r", [codes, scales],
                                              dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    # at byte j of a word the first output holds code j of the word's eight, the second code 4 + j
    values = tl.join(first, second).reshape(BLOCK_N, groups, 4, 4, 2)
    return values.permute(0, 1, 2, 4, 3).reshape(BLOCK_N, BLOCK_K)


@triton.jit
def _e2m1_halves(packed):
    """Packed E2M1 bytes -> (low nibbles, high nibbles) as fp16 holding each code's value times 2**-14.

    Three code bits under fp16's sign land on its two low exponent bits and its top mantissa bit:
    exponent e > 0 reads (1 + m/2) * 2**(e-15), and e = 0 is fp16's subnormal m/2 * 2**-14, which is
    E2M1's own subnormal, so the value is exact with no branch and no table."""
    b = packed.to(tl.int16)
    low = ((b & 7) << 9) | ((b & 8) << 12)
    high = ((b & 0x70) << 5) | ((b & 0x80) << 8)
    return low.to(tl.float16, bitcast=True), high.to(tl.float16, bitcast=True)


@triton.jit
def fp4_rows(packed, scale, dtype: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``fp4_rows_ptx`` in portable operations and any ``dtype``."""
    low, high = _e2m1_halves(packed)
    values = tl.join(low, high).reshape(BLOCK_N, BLOCK_K // 32, 32).to(tl.float32) * 16384.0
    scaled = values * e8m0_to_float(scale.to(tl.int32))[:, :, None]
    return scaled.reshape(BLOCK_N, BLOCK_K).to(dtype)
