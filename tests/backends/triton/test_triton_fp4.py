"""FP4 weight rows unpacked in registers (fp4.py) equal core/native's dequantization exactly.

Every byte value (two codes, the subnormal and both zeros among them) under random E8M0 scales
from the whole range whose products stay normal numbers (2**-125 to 2**127, both included): an
unpacked weight is a power of two times an E2M1 value, so anything but equality is a wrong bit. ``fp4_rows`` runs in the
interpreter; ``fp4_rows_ptx`` (inline PTX) only on an NVIDIA GPU; both compile for sm_90 ahead of
time with the unpacking in the packed bf16 multiply the PTX names.
"""

import pytest
import torch
import triton
import triton.language as tl

from engine.backends.triton.fp4 import fp4_rows, fp4_rows_ptx
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
