"""Two decode GEMVs in one launch, the second fed by an RMSNorm of the first's leading columns
(gemv_chain.py), against the two launches they replace (gemv.py's ``gemv`` then ``norm_gemv``) and
core/native's composition (``NativeLinear.projection_then_normed``).

Fresh random inputs every run, outputs poisoned first (``poisoned_empty``). The same bands, roundings
and norm as the two launches, so equal to them to the bit in the interpreter; the counters left at
zero. Block-FP8 weights (128 or 32 blocks, both or one of the two) likewise: the same dequantized
bands as the two GEMV launches on those weights, and core/native (which dequantizes first) within
the dtype's bound. ``TritonLinear`` takes the launch where the GEMV serves (on the CPU here only as a launch
count configures it) and composes otherwise.
"""

from __future__ import annotations

import pytest
import torch

from engine.backends.triton import gemv_chain
from engine.backends.triton.attention_decode import arrival_counters
from engine.backends.triton.gemv import GEMV, MAX_ROWS, gemv, norm_gemv
from engine.backends.triton.linear import TritonLinear
from engine.backends.triton.target import pick
from engine.core.families.linear import LinearWeight
from engine.core.native.linear import NativeLinear
from engine.core.native.norm import NativeNorm
from engine.core.native.quant import quantize_fp8_block

from aot import (GRID_DEPENDENCY, LDS_BYTES, SHARED_BYTES, TARGETS, amd_scratch_and_lds, compile_asm, local_memory_ops,
                 pdl)

CPU = torch.device("cpu")


class GemvLinear(TritonLinear):
    gemv_devices = ("cuda", "cpu")


def operands(m, k, n1, take, n2, dtype):
    x = (torch.randn(m, k) * 2).to(dtype)
    first = (torch.randn(n1, k) * k ** -0.5).to(dtype)
    norm = 1 + 0.1 * torch.randn(take)
    second = (torch.randn(n2, take) * take ** -0.5).to(dtype)
    return x, first, norm, second


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,k,n1,take,n2", [(1, 96, 52, 20, 36), (3, 64, 40, 32, 24), (8, 128, 16, 16, 70)])
def test_one_launch_equals_the_two(seed, poisoned_empty, dtype, m, k, n1, take, n2):
    """Bands past N (52, 36, 70 of 8 and 16), K past a step (96 of 64), the second's columns ending
    inside a band (20 of 8) or on one; one to eight rows; the norm weight fp32 or of x's dtype."""
    x, first, norm, second = operands(m, k, n1, take, n2, dtype)
    norm = norm.to(dtype) if m == 3 else norm
    out1, out2 = gemv_chain.gemv_chain(x, first, take, norm, 1e-6, second)
    want1 = gemv(x, first)
    want2, _ = norm_gemv(want1[:, :take], None, norm, 1e-6, second)
    assert torch.equal(out1, want1) and torch.equal(out2, want2)
    assert not arrival_counters(3, CPU)[:3].any()
    native1, native2 = NativeLinear(None).projection_then_normed(x, LinearWeight(first), take, norm, 1e-6,
                                                                 LinearWeight(second), NativeNorm(None))
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(out1, native1, **tol)
    torch.testing.assert_close(out2, native2, **tol)


def fp8_or_plain(w, block):
    """w block-FP8 (E4M3, fp32 scales of ``block`` x ``block``) or, block 0, as it is."""
    if not block:
        return LinearWeight(w)
    data, scale = quantize_fp8_block(w.float(), block)
    return LinearWeight(data, "fp8_block", scale)


def fp8_operands(m, k, n1, take, n2, dtype, blocks):
    x, first, norm, second = operands(m, k, n1, take, n2, dtype)
    return x, fp8_or_plain(first, blocks[0]), norm, fp8_or_plain(second, blocks[1])


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("blocks", [(128, 128), (32, 32), (128, 0), (0, 32)], ids=str)
@pytest.mark.parametrize("m,k,n1,take,n2", [(1, 160, 136, 40, 72), (3, 100, 70, 50, 40), (8, 72, 36, 36, 136)])
def test_fp8_one_launch_equals_the_two(seed, poisoned_empty, dtype, blocks, m, k, n1, take, n2):
    """Block-FP8 weights, both or one (the other in x's dtype): K, N and the second's K past a block
    (160, 136, 40 of 128; 100, 70, 50 of 32) and past a K step; one to eight rows. Bit-equal to the
    two GEMV launches on the same weights and scales; native (the weights dequantized, then the
    products) within the dtype's rounding."""
    x, first, norm, second = fp8_operands(m, k, n1, take, n2, dtype, blocks)
    out1, out2 = gemv_chain.gemv_chain(x, first.data, take, norm, 1e-6, second.data, first.scale, second.scale)
    want1 = gemv(x, first.data, scale=first.scale)
    want2, _ = norm_gemv(want1[:, :take], None, norm, 1e-6, second.data, scale=second.scale)
    assert torch.equal(out1, want1) and torch.equal(out2, want2)
    assert not arrival_counters(3, CPU)[:3].any()
    native1, native2 = NativeLinear(None).projection_then_normed(x, first, take, norm, 1e-6, second, NativeNorm(None))
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(out1, native1, **tol)
    torch.testing.assert_close(out2, native2, **tol)


@pytest.mark.interpret
@pytest.mark.parametrize("blocks", [(128, 128), (32, 32)], ids=str)
def test_backend_chains_block_fp8_weights(seed, monkeypatch, blocks):
    """A published FP8 checkpoint's groups (wq_a with wkv, wq_b with the indexer's) take the one
    launch at a decode step's rows, as plain ones do."""
    calls = []
    launch = gemv_chain.gemv_chain
    monkeypatch.setattr(gemv_chain, "gemv_chain", lambda *a: calls.append(a[0].shape[0]) or launch(*a))
    x, first, norm, second = fp8_operands(2, 64, 40, 16, 24, torch.float32, blocks)
    got = GemvLinear(None).projection_then_normed(x, first, 16, norm, 1e-6, second, NativeNorm(None))
    want = NativeLinear(None).projection_then_normed(x, first, 16, norm, 1e-6, second, NativeNorm(None))
    assert calls == [2]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.interpret
def test_backend_takes_the_launch_where_the_gemv_serves(seed, monkeypatch):
    calls = []
    launch = gemv_chain.gemv_chain
    monkeypatch.setattr(gemv_chain, "gemv_chain", lambda *a: calls.append(a[0].shape[0]) or launch(*a))
    for rows, backend, one in ((MAX_ROWS, GemvLinear(None), True), (MAX_ROWS + 1, GemvLinear(None), False),
                               (1, TritonLinear(None), False)):
        x, first, norm, second = operands(rows, 64, 40, 16, 24, torch.float32)
        calls.clear()
        got = backend.projection_then_normed(x, LinearWeight(first), 16, norm, 1e-6, LinearWeight(second),
                                             NativeNorm(None))
        want = NativeLinear(None).projection_then_normed(x, LinearWeight(first), 16, norm, 1e-6,
                                                         LinearWeight(second), NativeNorm(None))
        assert calls == ([rows] if one else [])
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_refuses_what_it_does_not_chain():
    x, first, norm, second = operands(1, 64, 40, 16, 24, torch.float32)
    with pytest.raises(ValueError, match="run them apart"):
        gemv_chain.gemv_chain(x, first, 16, norm, 1e-6, second.half())
    with pytest.raises(ValueError, match="run them apart"):
        gemv_chain.gemv_chain(x, first, 41, torch.ones(41), 1e-6, torch.randn(24, 41))
    fp8 = fp8_or_plain(first, 32)
    for scale in (None, fp8.scale[:1], fp8.scale.to(torch.uint8)):  # none, a wrong shape, not fp32
        assert not gemv_chain.fits(x, fp8.data, 16, norm, second, scale)
        with pytest.raises(ValueError, match="run them apart"):
            gemv_chain.gemv_chain(x, fp8.data, 16, norm, 1e-6, second, scale)
    assert not gemv_chain.fits(x, first, 16, norm, second, fp8.scale)  # a plain weight given a scale


SIGNATURE = {"x_ptr": "*bf16", "w1_ptr": "*bf16", "s1_ptr": "*fp32", "out1_ptr": "*bf16", "w2_ptr": "*bf16",
             "s2_ptr": "*fp32", "out2_ptr": "*bf16", "norm_ptr": "*fp32", "counters_ptr": "*i32", "M": "i32",
             "N1": "i32", "K1": "i32", "N2": "i32", "K2": "i32", "stride_xm": "i32", "stride_w1": "i32",
             "stride_s1": "i32", "stride_o1": "i32", "stride_w2": "i32", "stride_s2": "i32", "stride_o2": "i32",
             "eps": "fp32"}


@pytest.mark.aot
@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("rows,block", [(1, 0), (8, 0), (1, 128), (8, 128), (1, 32), (8, 32)])
def test_one_launch_compiles(target, rows, block):
    """DeepSeek-V4-Flash's attention input projections (hidden 4096) then its query projections (q_lora
    1024), in bf16 or block-FP8 (V4's 128-blocks, V4.1's 32), at one row (CUDA cores) and at eight
    (tl.dot): no spills on NVIDIA, no scratch on AMD; the ticket, the flag's release and acquire and
    the arrival at GPU scope; PDL on NVIDIA."""
    tuning = pick(GEMV, target)
    cfg1, cfg2 = tuning.for_shape(rows, 4096), tuning.for_shape(rows, 1024)
    weight = "*fp8e4nv" if block else "*bf16"
    constexprs = dict(BLOCK_M=1 if rows == 1 else 16, BLOCK_N=cfg1.block_n, BLOCK_K1=cfg1.block_k,
                      BLOCK_K2=cfg2.block_k, EVEN_K1=True, EVEN_K2=True, ROUND_BEFORE_WEIGHT=False,
                      SCALE_BLOCK1=block, SCALE_BLOCK2=block, PDL=pdl(target))
    cuda = TARGETS[target].backend == "cuda"
    asm = compile_asm(gemv_chain.gemv_chain_kernel, dict(SIGNATURE, w1_ptr=weight, w2_ptr=weight), constexprs,
                      target, **gemv_chain._launch_shape(cfg1, cfg2, bool(block)), sass=cuda,
                      divisible_by_16=["K1", "K2", "stride_xm", "stride_w1", "stride_o1", "stride_w2"])
    if cuda:
        ptx = asm["ptx"]
        assert all(op in ptx for op in ("atom.global.gpu.relaxed.add", "atom.global.gpu.acq_rel.add", *GRID_DEPENDENCY))
        # the flag's release (no result used: a reduction) and its acquire (adding 0: a load)
        assert "red.global.gpu.release.add" in ptx and "ld.global.gpu.acquire" in ptx
        assert local_memory_ops(asm["sass"]) == 0
    else:
        scratch, lds = amd_scratch_and_lds(asm)
        assert "global_atomic_add" in asm["amdgcn"] and scratch == 0 and lds <= LDS_BYTES[target]


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 4])
def test_one_launch_gpu(seed, rows):
    """DeepSeek-V4-Flash's two projections in bf16 on the GPU: within a bf16 ulp of the two launches,
    eager and replayed from a CUDA graph on fresh inputs (the counters left at zero)."""
    x, first, norm, second = (t.cuda() for t in operands(rows, 4096, 4096 + 512, 1024, 64 * 512 + 64 * 128,
                                                            torch.bfloat16))

    def check(got):
        want1 = gemv(x, first) if rows == 1 else torch.nn.functional.linear(x, first)
        want2, _ = norm_gemv(want1[:, :1024], None, norm, 1e-6, second)
        torch.testing.assert_close(got[0], want1, rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(got[1], want2, rtol=1e-2, atol=1e-2)
        assert not arrival_counters(3, x.device)[:3].any()

    check(gemv_chain.gemv_chain(x, first, 1024, norm, 1e-6, second))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemv_chain.gemv_chain(x, first, 1024, norm, 1e-6, second)
    for _ in range(2):
        x.copy_(torch.randn_like(x) * 2)
        graph.replay()
        check(out)


@pytest.mark.aot
@pytest.mark.parametrize("target", sorted(TARGETS))
def test_fp32_rows_fit_the_shared_memory(target):
    """fp32 operands at eight rows (a drafter's fp32 decode steps), V4-Flash's projections: the tiles
    the launch pipelines fit one block's shared memory (LDS on AMD); at three stages they took 228
    KiB on sm_90, over an H100's 227, and its decode graphs failed to capture."""
    tuning = pick(GEMV, target)
    cfg1, cfg2 = tuning.for_shape(8, 4096, itemsize=4), tuning.for_shape(8, 1024, itemsize=4)
    signature = {name: "*fp32" if kind == "*bf16" else kind for name, kind in SIGNATURE.items()}
    constexprs = dict(BLOCK_M=16, BLOCK_N=cfg1.block_n, BLOCK_K1=cfg1.block_k, BLOCK_K2=cfg2.block_k, EVEN_K1=True,
                      EVEN_K2=True, ROUND_BEFORE_WEIGHT=False, SCALE_BLOCK1=0, SCALE_BLOCK2=0, PDL=pdl(target))
    asm = compile_asm(gemv_chain.gemv_chain_kernel, signature, constexprs, target,
                      **gemv_chain._launch_shape(cfg1, cfg2, False),
                      divisible_by_16=["K1", "K2", "stride_xm", "stride_w1", "stride_o1", "stride_w2"])
    assert int(asm["shared"]) <= {**SHARED_BYTES, **LDS_BYTES}[target]
