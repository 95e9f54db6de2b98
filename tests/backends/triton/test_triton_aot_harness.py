"""The AOT harness compiles for all four targets, also while the interpreter is on."""

from __future__ import annotations

import pytest
import triton
import triton.language as tl

from aot import TARGETS, compilable, compile_asm

pytestmark = pytest.mark.aot


@triton.jit
def _scale(x, factor):
    return x * factor


@triton.jit
def _scaled_copy(src, dst, n, factor, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst + offs, _scale(tl.load(src + offs, mask=mask), factor), mask=mask)


SIGNATURE = {"src": "*fp16", "dst": "*fp16", "n": "i32", "factor": "fp32"}


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_compiles_for_target(target):
    asm = compile_asm(_scaled_copy, SIGNATURE, {"BLOCK": 1024}, target)
    assert {"ttir", "ttgir", "llir"} <= asm.keys()
    if target.startswith("sm_"):
        assert f".target {target}a" in asm["ptx"]
        assert "ld.global" in asm["ptx"] and "st.global" in asm["ptx"]
    else:
        assert f"gfx{target[3:]}" in asm["amdgcn"]
        assert "global_load" in asm["amdgcn"] or "buffer_load" in asm["amdgcn"]


def test_aligned_pointers_vectorize():
    """Pointers are taken as 16-byte aligned, as a real launch specializes them: 128-bit accesses."""
    asm = compile_asm(_scaled_copy, SIGNATURE, {"BLOCK": 1024}, "sm_90", divisible_by_16=["n"])
    assert "ld.global.v4" in asm["ptx"]


def test_helpers_become_compilable():
    """Under TRITON_INTERPRET=1 the kernel and its helper are interpreted; both are rebuilt."""
    fn = compilable(_scaled_copy)
    assert isinstance(fn, triton.runtime.jit.JITFunction)
    assert isinstance(fn.__globals__["_scale"], triton.runtime.jit.JITFunction)


def test_missing_argument_is_named():
    with pytest.raises(ValueError, match="factor"):
        compile_asm(_scaled_copy, {k: v for k, v in SIGNATURE.items() if k != "factor"}, {"BLOCK": 64}, "sm_90")
