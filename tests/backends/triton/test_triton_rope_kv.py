"""Fused (q/k RMSNorm +) RoPE + KV-page store against native norm, rope and the native attention's page store."""

from __future__ import annotations

import random

import pytest
import torch

from aot import GRID_DEPENDENCY, TARGETS, amdgcn_target, compile_asm, pdl

from engine.backends.triton import rope_kv
from engine.backends.triton.rope_kv import rope_store_kv, rope_store_kv_kernel
from engine.core.families.attention import AttentionLayer, LayerKV, QKNorm
from engine.core.forward import ForwardBatch
from engine.core.native.attention import NativeAttention
from engine.core.native.rope import RotaryEmbedding

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3),
       torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}


class Case:
    """A batch of sequences (cached prefix, new tokens) on shuffled pages of a NaN-filled pool;
    ``norm_dtype``: per-head q/k RMSNorm weights of that dtype (None: no norm)."""

    def __init__(self, lens, heads, kv_heads, head_dim, rotary_dim, page_size, dtype, device,
                 cache_dtype=None, v_head_dim=None, neox=True, max_position=4096, scaling=None, norm_dtype=None):
        cache_dtype = cache_dtype or dtype
        v_head_dim = v_head_dim or head_dim
        need = [-(-(c + q) // page_size) for c, q in lens]
        num_pages = sum(need) + 3
        ids = random.sample(range(num_pages), num_pages)  # page 0 too: slot 0 is a real slot
        tables = [ids[sum(need[:i]):sum(need[:i + 1])] for i in range(len(lens))]
        ctx, qlens = [c for c, _ in lens], [q for _, q in lens]
        assert max(c + q for c, q in lens) <= max_position
        self.batch = ForwardBatch.build(input_ids=[0] * sum(qlens), query_lens=qlens, context_lens=ctx,
                                        page_tables=tables, page_size=page_size, logits_indices=[],
                                        device=device)
        tokens = sum(qlens)
        self.q = torch.randn(tokens, heads, head_dim, device=device).to(dtype)
        self.k = torch.randn(tokens, kv_heads, head_dim, device=device).to(dtype)
        self.v = torch.randn(tokens, kv_heads, v_head_dim, device=device).to(dtype)
        self.qk_norm = None if norm_dtype is None else QKNorm(
            *((1 + 0.5 * torch.randn(head_dim, device=device)).to(norm_dtype) for _ in "qk"), eps=1e-6)
        self.rope = RotaryEmbedding(head_dim, rotary_dim, max_position, 10000.0, scaling, is_neox_style=neox,
                                    device=device)
        self.layer = AttentionLayer(layer_id=0, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                                    scale=head_dim ** -0.5, v_head_dim=v_head_dim)
        self.pool = (num_pages, page_size, kv_heads)
        self.dims = (head_dim, v_head_dim, cache_dtype, device)

    def pages(self) -> LayerKV:
        head_dim, v_head_dim, cache_dtype, device = self.dims
        return LayerKV(k=torch.full((*self.pool, head_dim), float("nan"), dtype=cache_dtype, device=device),
                       v=torch.full((*self.pool, v_head_dim), float("nan"), dtype=cache_dtype, device=device))

    def native(self) -> tuple[torch.Tensor, LayerKV]:
        q, k = (self.q, self.k) if self.qk_norm is None else self.qk_norm.apply(self.q, self.k)
        q, k = self.rope.apply(q, k, self.batch.positions)
        kv = self.pages()
        NativeAttention(ctx=None).forward(q, k, self.v, kv, self.layer, self.batch)  # stores, then attends
        return q, kv

    def check(self):
        want_q, want_kv = self.native()
        kv = self.pages()
        q = rope_store_kv(self.q, self.k, self.v, self.batch.positions, self.batch.slot_mapping, self.rope, kv,
                          q_out=torch.full_like(self.q, float("nan")), qk_norm=self.qk_norm)
        torch.testing.assert_close(q, want_q, **TOL[q.dtype])
        cache_tol = TOL[max(q.dtype, kv.k.dtype, key=lambda d: torch.finfo(d).eps)]
        # untouched slots stay NaN; the written ones hold the rotated k and the plain v
        torch.testing.assert_close(kv.k, want_kv.k, equal_nan=True, **cache_tol)
        torch.testing.assert_close(kv.v, want_kv.v, equal_nan=True, rtol=0, atol=0)
        if q.dtype != torch.float32:  # the oracle's rounding steps: nearly every bit agrees
            assert (q == want_q).float().mean() > 0.98
            written = ~want_kv.k.isnan()
            assert (kv.k[written] == want_kv.k[written]).float().mean() > 0.98


LENS = [(3, 5), (0, 4), (6, 1), (9, 2)]


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("neox", [True, False])
def test_full_rotary_interpreted(seed, dtype, neox):
    Case(LENS, 4, 2, 32, 32, 4, dtype, "cpu", neox=neox).check()


@pytest.mark.interpret
@pytest.mark.parametrize("rotary_dim", [16, 24])
def test_partial_rotary_interpreted(seed, rotary_dim):
    """Only the first rotary_dim channels turn (24: a half that is no power of two)."""
    Case(LENS, 4, 1, 64, rotary_dim, 8, torch.float16, "cpu").check()


@pytest.mark.interpret
def test_cache_dtype_and_v_head_dim_interpreted(seed):
    """fp32 activations into fp16 pages; v narrower than k; YaRN's attention factor in cos/sin."""
    Case(LENS, 2, 2, 32, 32, 4, torch.float32, "cpu", cache_dtype=torch.float16, v_head_dim=16,
         scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}).check()


@pytest.mark.interpret
@pytest.mark.parametrize("norm_dtype", [None, torch.float16])
def test_head_blocks_interpreted(seed, monkeypatch, norm_dtype):
    """Heads split over several programs, query and KV blocks both partly masked."""
    monkeypatch.setitem(rope_kv.ROPE_KV, "default", rope_kv.RopeConfig(pairs_per_program=32, num_warps=1))
    Case(LENS, 6, 3, 32, 32, 4, torch.float16, "cpu", norm_dtype=norm_dtype).check()


@pytest.mark.interpret
@pytest.mark.parametrize("dtype,norm_dtype", [(torch.float32, torch.float32), (torch.float16, torch.float16),
                                              (torch.float16, torch.float32)])
@pytest.mark.parametrize("rotary_dim", [64, 24])
@pytest.mark.parametrize("neox", [True, False])
def test_qk_norm_interpreted(seed, dtype, norm_dtype, rotary_dim, neox):
    """Per-head RMSNorm before the rotation: a weight in the activation dtype multiplies the rounded
    normalised row, an fp32 one the unrounded; with partial rotary the unrotated tail is normalised too."""
    Case(LENS, 4, 2, 64, rotary_dim, 4, dtype, "cpu", neox=neox, norm_dtype=norm_dtype).check()


@pytest.mark.interpret
def test_qk_norm_weights_must_fit(seed):
    case = Case([(0, 2)], 2, 1, 32, 32, 4, torch.float32, "cpu")
    bad = QKNorm(torch.ones(32), torch.ones(16), 1e-6)
    with pytest.raises(ValueError, match="norm weights"):
        rope_store_kv(case.q, case.k, case.v, case.batch.positions, case.batch.slot_mapping, case.rope,
                      case.pages(), qk_norm=bad)


@pytest.mark.interpret
@pytest.mark.parametrize("norm_dtype", [None, torch.float16])
def test_negative_slot_writes_nothing_interpreted(seed, norm_dtype):
    case = Case([(0, 6)], 2, 2, 32, 32, 4, torch.float16, "cpu", norm_dtype=norm_dtype)
    kv = case.pages()
    slots = case.batch.slot_mapping.clone()
    slots[::2] = -1
    q = rope_store_kv(case.q, case.k, case.v, case.batch.positions, slots, case.rope, kv, qk_norm=case.qk_norm)
    want_q, want_kv = case.native()
    torch.testing.assert_close(q, want_q, **TOL[torch.float16])
    keep = slots >= 0
    flat_k, flat_want = kv.k.view(-1, 2, 32), want_kv.k.view(-1, 2, 32)
    torch.testing.assert_close(flat_k[slots[keep]], flat_want[slots[keep]], **TOL[torch.float16])
    assert flat_k[case.batch.slot_mapping[~keep]].isnan().all()
    assert kv.k.isnan().sum() == want_kv.k.isnan().sum() + int((~keep).sum()) * 2 * 32


@pytest.mark.gpu
@pytest.mark.parametrize("batch", ["prefill-8192", "mixed", "decode-256"])
@pytest.mark.parametrize("heads,kv_heads,head_dim,rotary_dim", [(32, 8, 128, 128), (16, 8, 128, 64),
                                                                (64, 4, 256, 256)])
def test_rope_store_kv_gpu(seed, batch, heads, kv_heads, head_dim, rotary_dim):
    lens = {"prefill-8192": [(0, 8192)], "mixed": [(1000, 3000), (0, 4096), (500, 1096)],
            "decode-256": [(random.randint(1, 8191), 1) for _ in range(256)]}[batch]
    Case(lens, heads, kv_heads, head_dim, rotary_dim, 16, torch.bfloat16, "cuda", max_position=16384).check()


@pytest.mark.gpu
@pytest.mark.parametrize("batch", ["prefill-8192", "mixed", "decode-1", "decode-256"])
def test_rope_store_kv_qk_norm_gpu(seed, batch):
    """Qwen3-0.6B heads in bf16 with its bf16 q/k norm weights."""
    lens = {"prefill-8192": [(0, 8192)], "mixed": [(1000, 3000), (0, 4096), (500, 1096)], "decode-1": [(4000, 1)],
            "decode-256": [(random.randint(1, 8191), 1) for _ in range(256)]}[batch]
    Case(lens, 16, 8, 128, 128, 16, torch.bfloat16, "cuda", max_position=16384, norm_dtype=torch.bfloat16).check()


@pytest.mark.aot
@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_store_kv_compiles(target, qk_norm):
    """Llama-3.1-8B heads in bf16, and Qwen3-0.6B heads with its bf16 q/k norms: 16-byte loads of
    q/k and 16-byte stores into the pages, and (as launched, without FP fusion) no fused
    multiply-add that would skip the oracle's rounding step."""
    pointers = ["q_ptr", "k_ptr", "v_ptr", "q_out_ptr", "k_cache_ptr", "v_cache_ptr", "q_norm_ptr", "k_norm_ptr"]
    strides = [name for name in rope_store_kv_kernel.arg_names if name.startswith("stride_")]
    signature = {**{p: "*bf16" for p in pointers}, "cos_ptr": "*fp32", "sin_ptr": "*fp32",
                 "positions_ptr": "*i64", "slots_ptr": "*i64", "eps": "fp32", **{s: "i32" for s in strides}}
    heads = dict(NUM_HEADS=16, Q_BLOCKS=1) if qk_norm else dict(NUM_HEADS=32, Q_BLOCKS=2)
    constexprs = dict(**heads, NUM_KV_HEADS=8, HEAD_DIM=128, V_HEAD_DIM=128, ROT_HALF=64, PAGE_SIZE=16,
                      IS_NEOX=True, QK_NORM=qk_norm, ROUND_BEFORE_WEIGHT=qk_norm, BLOCK_H=16, BLOCK_HALF=64,
                      BLOCK_REST=0, BLOCK_DV=128, PDL=pdl(target))
    asm = compile_asm(rope_store_kv_kernel, signature, constexprs, target, divisible_by_16=strides,
                      enable_fp_fusion=False)
    if target.startswith("sm_"):
        ptx = asm["ptx"]
        assert f".target {target}a" in ptx
        assert "ld.global.v4.b32" in ptx and "st.global.v4.b32" in ptx
        assert "fma.rn" not in ptx
        assert all(op in ptx for op in GRID_DEPENDENCY)
    else:
        gcn = asm["amdgcn"]
        assert target in amdgcn_target(gcn)
        assert "load_dwordx4" in gcn and "store_dwordx4" in gcn
