"""FP8 and MXFP8 activations quantized inside the fused MoE's grouped GEMMs, tile by tile as loaded.

Against the unfused composition (a quantization launch before each GEMM) to the bit, fresh inputs
every run, outputs poisoned first, with no quantization launch at all (the launchers are replaced by
ones that fail); against native within the bound of the activations' roundings. bf16 runs here too:
the dot's operands are E4M3 either way (the interpreter's bf16 dot is what goes wrong).
"""

from __future__ import annotations

import pytest
import torch
from test_triton_moe import (DEEPSEEK_V4_FLASH, activations, fp4_experts, random_experts, random_ids, rel_err,
                             routing_weights, stack_in)

from engine.backends.triton import fused_moe as fused
from engine.backends.triton.fp8_gemm import GemmConfig
from engine.backends.triton.fused_moe import fused_moe, quantizes_in_gemm
from engine.backends.triton.moe_tiles import FP4_SCALED_MMA, MOE_FP4_GEMM, MOE_GEMM, MOE_GEMM_32
from engine.backends.triton.target import pick
from engine.core.native.moe import NativeMoE

DECODE = GemmConfig(16, 32, 128, 1, 4, 1)  # K steps of one FP8 scale group, as the GPUs' decode tiles


def no_quantization_launch(monkeypatch):
    def refused(*args, **kwargs):
        raise AssertionError("a quantization launch")

    monkeypatch.setattr(fused, "quantize_fp8_token_group", refused)
    monkeypatch.setattr(fused, "quantize_mxfp8", refused)


def run(x, weights, ids, w, in_gemm, config=DECODE):
    out = torch.full_like(x, float("nan"))
    got = fused_moe(x, weights, ids, w.gate_up, w.down, swiglu_limit=w.swiglu_limit, gate_up_scale=w.gate_up_scale,
                    down_scale=w.down_scale, out=out, scaled_mma=True, config=config, quantize_in_gemm=in_gemm)
    assert got.data_ptr() == out.data_ptr() and not got.isnan().any()
    return got


@pytest.mark.interpret
# FP8 and MXFP8: two roundings of the activations that native does not make. Over 300 seeds of one
# token in fp32 the relative error reached 0.097 (FP8) and 0.109 (MXFP8), medians 0.055 and 0.065:
# one token's 256 outputs spread more than test_triton_moe's batches, whose bound was 0.1 here too
@pytest.mark.parametrize("scheme,bound", [("fp8_block", 0.15), ("fp4", 0.15)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("tokens,hidden", [(1, 256), (3, 160)], ids=["one-token", "K-tail"])
def test_quantized_in_the_gemms_equals_a_launch_before_each(seed, monkeypatch, scheme, bound, dtype, tokens, hidden):
    """One token (most of the 8 experts get none) and three; H = 160: the second K step is 32 channels
    and zeros, which quantize to what the launch leaves there."""
    num_experts, top_k, inner = 8, 2, 128
    w = stack_in(scheme, random_experts(num_experts, hidden, inner, torch.float32, swiglu_limit=1.0))
    x = activations(tokens, hidden, dtype, scale=2.0)
    weights, ids = routing_weights(tokens, top_k), random_ids(tokens, num_experts, top_k)
    apart = run(x, weights, ids, w, in_gemm=False)
    no_quantization_launch(monkeypatch)
    fused_run = run(x, weights, ids, w, in_gemm=True)
    assert torch.equal(fused_run, apart)
    if dtype != torch.bfloat16:  # native's bf16 products would run the interpreter's bf16 dot
        assert rel_err(fused_run, NativeMoE(None).experts(x, weights, ids, w)) < bound


def test_which_steps_quantize_in_the_gemms():
    """Decode-sized rows per expert with the targets' decode tiles; not prefill's many rows, nor FP8 K
    steps that are not one scale group (the CPU's default tiles)."""
    here = torch.device("cpu")  # rows per expert against the CPU's small_m (2): the tiles are the targets'
    for table, block in ((MOE_GEMM, 128), (MOE_FP4_GEMM, None)):
        small, large = pick(table, "sm_90").small, pick(table, "sm_90").large
        cpu = pick(table, "default")
        assert quantizes_in_gemm(small, 1, 6, 256, here, fp8_block=block)
        assert not quantizes_in_gemm(large, 4096, 6, 256, here, fp8_block=block)
        assert quantizes_in_gemm(cpu.small, 1, 6, 256, here, fp8_block=block) == (not block)
    # 32-blocks (DeepSeek-V4.1's shared expert): K steps of 32 everywhere, the CPU's too
    assert all(quantizes_in_gemm(pick(MOE_GEMM_32, target).small, 1, 6, 256, here, fp8_block=32)
               for target in ("sm_90", "default"))
    assert not quantizes_in_gemm(pick(MOE_GEMM, "sm_90").small, 1, 6, 256, here, fp8_block=32)
    assert pick(MOE_GEMM, "sm_90").small.block_k == pick(MOE_GEMM, "gfx950").small.block_k == 128


@pytest.mark.interpret
def test_fp8_in_the_gemm_needs_one_scale_group_a_k_step(seed):
    w = stack_in("fp8_block", random_experts(4, 128, 128, torch.float32))
    with pytest.raises(ValueError, match="need K steps of 128"):
        run(activations(2, 128, torch.float32), routing_weights(2, 2), random_ids(2, 4, 2), w, True,
            config=GemmConfig(16, 32, 64, 1, 4, 1))


# GPU: DeepSeek-V4-Flash expert shapes


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", ["fp8_block", "fp4"])
@pytest.mark.parametrize("tokens", [1, 16])
def test_quantized_in_the_gemms_gpu(seed, scheme, tokens):
    """A quarter of the experts, bf16 activations: the decode path (by default for these tokens)
    equals a quantization launch before each GEMM to the bit (FP4: where the target has the
    block-scaled MMA; elsewhere its activations are not quantized at all)."""
    from engine.backends.triton.target import arch_of

    if scheme == "fp4" and not pick(FP4_SCALED_MMA, arch_of(torch.device("cuda"))):
        pytest.skip("FP4 experts meet unquantized activations on this target")
    shape = dict(DEEPSEEK_V4_FLASH, num_experts=64)
    e, k = shape["num_experts"], shape["top_k"]
    w32 = random_experts(e, shape["hidden"], shape["inner"], torch.float32, "cuda", shape["limit"])
    w = fp4_experts(w32) if scheme == "fp4" else stack_in(scheme, w32)
    x = activations(tokens, shape["hidden"], torch.bfloat16, "cuda", scale=2.0)
    weights, ids = routing_weights(tokens, k, "cuda"), random_ids(tokens, e, k, "cuda")
    cfg = fused.moe_config(tokens, k, e, x.device, fp4=scheme == "fp4")
    assert quantizes_in_gemm(cfg, tokens, k, e, x.device, fp8_block=128 if scheme == "fp8_block" else None)
    by_default = fused_moe(x, weights, ids, w.gate_up, w.down, swiglu_limit=w.swiglu_limit,
                           gate_up_scale=w.gate_up_scale, down_scale=w.down_scale)
    assert torch.equal(by_default, run(x, weights, ids, w, in_gemm=False, config=cfg))


# ahead-of-time compilation: the decode tiles with unquantized bf16 activations reach the same
# matrix instructions as E4M3 activations do (the FP8 tile of 16 rows stays on f16 mma.sync on NVIDIA,
# as the E4M3 operands did before)

QUANTIZED_MMA = {("fp8", "sm_90"): r"mma\.sync\S*\.f16\.f16", ("fp8", "sm_100"): r"mma\.sync\S*\.f16\.f16",
                 ("fp8", "gfx942"): r"v_mfma_f32_\w+_f16", ("fp8", "gfx950"): r"v_mfma_f32_\w+_f8f6f4",
                 ("fp4", "sm_100"): r"tcgen05\.mma\S*kind::mxf8f6f4\.block_scale",
                 ("fp4", "gfx950"): r"v_mfma_scale_f32_\w+_f8f6f4"}


@pytest.mark.aot
@pytest.mark.parametrize("kind,target", sorted(QUANTIZED_MMA))
@pytest.mark.parametrize("gated", [True, False], ids=["gate_up", "down"])
def test_quantizing_gemm_compiles(kind, target, gated):
    import re

    from aot import compile_asm, pdl
    from test_triton_moe import SIGNATURE

    fp4 = kind == "fp4"
    cfg = pick(MOE_FP4_GEMM if fp4 else MOE_GEMM, target).small
    signature = {**SIGNATURE, "a_ptr": "*bf16", "a_scale_ptr": "*fp32", "c_ptr": "*bf16",
                 "b_ptr": "*u8" if fp4 else "*fp8e4nv", "b_scale_ptr": "*u8" if fp4 else "*fp32"}
    constexprs = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                      GATED=gated, HAS_LIMIT=gated, FP8=not fp4, SCALE_BLOCK=32 if fp4 else 128, PDL=pdl(target),
                      FP4=fp4, SCALED_MMA=fp4, EVEN_K=True, PTX_UNPACK=False, QUANTIZE_A=True, ACCUMULATE=False)
    asm = compile_asm(fused._moe_gemm_kernel, signature, constexprs, target, num_warps=cfg.num_warps,
                      num_stages=cfg.num_stages, divisible_by_16=["K", "stride_am", "stride_bn", "stride_cm",
                                                                  "stride_om"])
    text = asm.get("ptx") or asm["amdgcn"]
    assert re.search(QUANTIZED_MMA[kind, target], text), f"no {QUANTIZED_MMA[kind, target]} for {target}"
