"""FP4 weight rows unpacked in registers (fp4.py) equal core/native's dequantization exactly.

Every byte value (two codes, the subnormal and both zeros among them) under random E8M0 scales
from the whole range whose products stay normal numbers (2**-125 to 2**127, both included): an
unpacked weight is a power of two times an E2M1 value, so anything but equality is a wrong bit. ``fp4_rows`` runs in the
interpreter; ``fp4_rows_ptx`` (inline PTX) only on an NVIDIA GPU, and its PTX text here, run
instruction by instruction on 32-bit integers; both compile for sm_90 ahead of time with the
unpacking in the packed bf16 multiply the PTX names.
"""

import pytest
import torch
import triton
import triton.language as tl

from engine.backends.triton.fp4 import _UNPACK, fp4_rows, fp4_rows_ptx
from engine.core.native import quant

ROWS, K = 16, 128  # a weight tile: 16 rows of 4 scale groups


@triton.jit
def _unpack_kernel(packed_ptr, scale_ptr, out_ptr, ROWS: tl.constexpr, K: tl.constexpr, PTX: tl.constexpr):
    rn = tl.arange(0, ROWS)
    packed = tl.load(packed_ptr + rn[:, None] * (K // 2) + tl.arange(0, K // 2)[None, :])
    scale = tl.load(scale_ptr + rn[:, None] * (K // 32) + tl.arange(0, K // 32)[None, :])
    if PTX:
        rows = fp4_rows_ptx(packed, scale, ROWS, K)
    else:
        rows = fp4_rows(packed, scale, out_ptr.dtype.element_ty, ROWS, K)
    tl.store(out_ptr + rn[:, None] * K + tl.arange(0, K)[None, :], rows)


def random_tile(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Every byte value four times in random places; scales 2..254, the extremes among them."""
    packed = torch.arange(256, dtype=torch.int32).repeat(ROWS * K // 2 // 256)[torch.randperm(ROWS * K // 2)]
    scale = torch.randint(2, 255, (ROWS, K // 32), dtype=torch.int32)
    scale.view(-1)[:2] = torch.tensor([2, 254], dtype=torch.int32)
    return packed.to(torch.uint8).view(ROWS, K // 2).to(device), scale.to(torch.uint8).to(device)


def check_unpack(device: str, dtype: torch.dtype, ptx: bool) -> None:
    packed, scale = random_tile(device)
    out = torch.full((ROWS, K), float("nan"), dtype=dtype, device=device)
    _unpack_kernel[(1,)](packed, scale, out, ROWS=ROWS, K=K, PTX=ptx)
    want = quant.dequantize_fp4(packed.cpu(), scale.cpu()).to(dtype)
    torch.testing.assert_close(out.cpu(), want, rtol=0, atol=0, equal_nan=False)


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp4_rows_equal_native(seed, dtype):
    check_unpack("cpu", dtype, ptx=False)


@pytest.mark.gpu
@pytest.mark.parametrize("ptx", [True, False], ids=["ptx", "portable"])
def test_fp4_rows_equal_native_gpu(seed, ptx):
    check_unpack("cuda", torch.bfloat16, ptx)


@pytest.mark.aot
def test_fp4_rows_ptx_compiles_to_packed_bf16_multiplies():
    from aot import compile_asm

    asm = compile_asm(_unpack_kernel, {"packed_ptr": "*u8", "scale_ptr": "*u8", "out_ptr": "*bf16"},
                      dict(ROWS=ROWS, K=K, PTX=True), "sm_90", sass=True)
    assert "mul.rn.bf16x2" in asm["ptx"] and "HMUL2.BF16" in asm["sass"]


def _bf16_pair_mul(a: int, b: int) -> int:
    """mul.rn.bf16x2 on two registers (round to nearest even, as torch's bf16 cast does)."""
    halves = torch.tensor([[a & 0xFFFF, a >> 16], [b & 0xFFFF, b >> 16]], dtype=torch.int32)
    x = (halves << 16).view(torch.float32)
    bits = (x[0] * x[1]).to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
    return int(bits[0]) | int(bits[1]) << 16


def _prmt(a: int, b: int, selector: int) -> int:
    """prmt.b32's default mode: result byte i is byte s of {b, a} (s = selector nibble i, low 3 bits),
    or with the nibble's top bit that byte's sign bit copied through it."""
    source = [(a >> 8 * i) & 0xFF for i in range(4)] + [(b >> 8 * i) & 0xFF for i in range(4)]
    out = 0
    for i in range(4):
        nibble = selector >> 4 * i & 0xF
        byte = source[nibble & 7]
        out |= (0xFF if nibble & 8 and byte & 0x80 else 0 if nibble & 8 else byte) << 8 * i
    return out


def run_unpack_ptx(word: int, scale_pair: int) -> list[int]:
    """``_UNPACK`` run on one packed word and one register of two bf16 scales -> its four outputs."""
    regs = {"$4": word, "$5": scale_pair}
    value = lambda x: regs[x] if x in regs else int(x, 0)  # noqa: E731
    ops = {"mov.b32": lambda a: a, "and.b32": lambda a, b: a & b, "shr.b32": lambda a, b: a >> b,
           "mul.lo.u32": lambda a, b: a * b & 0xFFFFFFFF, "prmt.b32": _prmt, "mul.rn.bf16x2": _bf16_pair_mul}
    for statement in str(_UNPACK.value).replace("{", "").replace("}", "").split(";"):
        statement = statement.strip()
        if not statement or statement.startswith(".reg"):
            continue
        op, args = statement.split(None, 1)
        dst, *srcs = [a.strip() for a in args.split(",")]
        regs[dst] = ops[op](*map(value, srcs))
    return [regs[f"${i}"] for i in range(4)]


def test_unpack_ptx_text_decodes_every_byte_exactly(seed):
    """The PTX's integer steps and its output order: the first output's two registers hold a word's
    codes 0-3, the second's 4-7, each low half first, as ``fp4_rows_ptx`` arranges them."""
    for scale in torch.randint(2, 255, (8,)).tolist():
        bf16_scale = scale << 7
        for word in torch.randint(0, 2**32, (64,), dtype=torch.int64).tolist() + [0x76543210, 0xFEDCBA98]:
            out = run_unpack_ptx(word, bf16_scale | bf16_scale << 16)
            halves = torch.tensor([h for r in out for h in (r & 0xFFFF, r >> 16)], dtype=torch.int32)
            got = (halves << 16).view(torch.float32)
            packed = torch.tensor([word >> 8 * i & 0xFF for i in range(4)], dtype=torch.uint8)
            want = quant.dequantize_fp4(packed[None], torch.tensor([[scale]], dtype=torch.uint8))[0]
            assert torch.equal(got, want), (hex(word), scale)
