"""The AOT harness compiles for all four targets, also after kernels ran in the interpreter."""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl

from aot import TARGETS, amdgcn_target, compile_asm

pytestmark = pytest.mark.aot


@triton.jit
def _scale(x, factor):
    return x * factor


@triton.jit
def _scaled_copy(src, dst, n, factor, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst + offs, _scale(tl.load(src + offs, mask=mask), factor), mask=mask)


@triton.jit
def _row_sum(src, dst, n, BLOCK: tl.constexpr):
    """Reaches triton's own jitted ``tl.sum``, which the interpreter patches the language for."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    x = tl.load(src + row * n + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(dst + row, tl.sum(x, axis=0))


SIGNATURE = {"src": "*fp16", "dst": "*fp16", "n": "i32", "factor": "fp32"}


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_compiles_for_target(target):
    asm = compile_asm(_scaled_copy, SIGNATURE, {"BLOCK": 1024}, target)
    assert {"ttir", "ttgir", "llir"} <= asm.keys()
    if target.startswith("sm_"):
        assert f".target {target}a" in asm["ptx"]
        assert "ld.global" in asm["ptx"] and "st.global" in asm["ptx"]
    else:
        assert target in amdgcn_target(asm["amdgcn"])
        assert "global_load" in asm["amdgcn"] or "buffer_load" in asm["amdgcn"]


def test_aligned_pointers_vectorize():
    """Pointers are taken as 16-byte aligned, as a real launch specializes them: 128-bit accesses."""
    asm = compile_asm(_scaled_copy, SIGNATURE, {"BLOCK": 1024}, "sm_90", divisible_by_16=["n"])
    assert "ld.global.v4" in asm["ptx"]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="runs the kernel first: needs the interpreter or a GPU")
@pytest.mark.parametrize("target", sorted(TARGETS))
def test_compiles_after_a_launch(seed, target):
    """A launch (interpreted on CPU) must not spoil compiling the same kernel afterwards."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(3, 50, dtype=torch.float16, device=device)
    out = torch.full((3,), float("nan"), dtype=torch.float32, device=device)
    _row_sum[(3,)](x, out, 50, BLOCK=64)
    torch.testing.assert_close(out, x.float().sum(-1), rtol=1e-4, atol=1e-4)
    asm = compile_asm(_row_sum, {"src": "*fp16", "dst": "*fp32", "n": "i32"}, {"BLOCK": 64}, target)
    assert ("ptx" if target.startswith("sm_") else "amdgcn") in asm


def test_missing_argument_is_named():
    with pytest.raises(ValueError, match="factor"):
        compile_asm(_scaled_copy, {k: v for k, v in SIGNATURE.items() if k != "factor"}, {"BLOCK": 64}, "sm_90")


def test_compile_errors_surface():
    with pytest.raises(Exception, match="arange"):
        compile_asm(_scaled_copy, SIGNATURE, {"BLOCK": 1000}, "gfx950")  # not a power of two
