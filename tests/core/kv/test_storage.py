"""KVCache: page arrays per layer, their byte arithmetic, and page copies."""

from __future__ import annotations

import pytest
import torch

from engine.core.kv.storage import KVCache, KVLayerSpec, pages_for_budget

LAYERS = [KVLayerSpec(2, 8, 8), KVLayerSpec(1, 16, 0), KVLayerSpec(4, 4, 6)]
COMPRESSED = [KVLayerSpec(1, 8, 0, rate=4), KVLayerSpec(1, 8, 2, rate=16), KVLayerSpec(1, 4, 0, rate=3)]
FP8 = torch.float8_e4m3fn
OWN_TYPES = [KVLayerSpec(1, 16, 1, rate=4, k_dtype=FP8, v_dtype=torch.float32), KVLayerSpec(2, 4, 4, k_dtype=FP8)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
def test_bytes_per_page_matches_the_allocated_tensors(dtype):
    kv = KVCache(LAYERS, num_pages=5, page_size=16, dtype=dtype, device="cpu")
    allocated = sum(kv.layer(i).k.nbytes + kv.layer(i).v.nbytes for i in range(kv.num_layers))
    assert KVCache.bytes_per_page(LAYERS, 16, dtype) == allocated // 5
    per_token = 2 * (8 + 8) + 1 * 16 + 4 * (4 + 6)
    assert KVCache.bytes_per_page(LAYERS, 16, dtype) == 16 * per_token * torch.empty((), dtype=dtype).element_size()


@pytest.mark.parametrize("page_size", [1, 4, 6, 16, 32])
def test_a_compressed_layer_keeps_a_slot_per_rate_tokens_of_a_page(page_size):
    """ceil(page_size / rate) slots: enough for every window that closes inside the page."""
    kv = KVCache(LAYERS + COMPRESSED, num_pages=3, page_size=page_size, dtype=torch.bfloat16, device="cpu")
    for i, s in enumerate(COMPRESSED, start=len(LAYERS)):
        most = max(sum(1 for t in range(p * page_size, (p + 1) * page_size) if t % s.rate == s.rate - 1)
                   for p in range(s.rate))  # windows closing in one page, over every alignment
        assert kv.layer(i).k.shape == (3, max(1, most), 1, s.head_dim)
    allocated = sum(kv.layer(i).k.nbytes + kv.layer(i).v.nbytes for i in range(kv.num_layers))
    assert KVCache.bytes_per_page(LAYERS + COMPRESSED, page_size, torch.bfloat16) * 3 == allocated


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_layers_of_their_own_element_types(dtype):
    """E4M3 keys beside fp32 scales (DeepSeek-V4's indexer keys beside FP8 weights) in a cache of
    another dtype: each tensor of its own type, and the bytes per page count each as it is."""
    kv = KVCache(LAYERS + OWN_TYPES, num_pages=3, page_size=8, dtype=dtype, device="cpu")
    fp8_keys, fp8_kv = kv.layer(len(LAYERS)), kv.layer(len(LAYERS) + 1)
    assert (fp8_keys.k.dtype, fp8_keys.v.dtype, fp8_kv.k.dtype, fp8_kv.v.dtype) == (FP8, torch.float32, FP8, dtype)
    assert kv.layer(0).k.dtype == dtype
    allocated = sum(kv.layer(i).k.nbytes + kv.layer(i).v.nbytes for i in range(kv.num_layers))
    assert KVCache.bytes_per_page(LAYERS + OWN_TYPES, 8, dtype) * 3 == allocated
    assert OWN_TYPES[0].slot_bytes(dtype) == 16 + 4
    assert OWN_TYPES[1].slot_bytes(dtype) == 2 * (4 + 4 * dtype.itemsize)


def test_layers_have_the_spec_shapes_and_start_zeroed():
    kv = KVCache(LAYERS, num_pages=3, page_size=4, dtype=torch.float16, device="cpu")
    for i, s in enumerate(LAYERS):
        layer = kv.layer(i)
        assert layer.k.shape == (3, 4, s.num_kv_heads, s.head_dim) and layer.k.dtype == torch.float16
        assert layer.v.shape == (3, 4, s.num_kv_heads, s.v_head_dim)
        assert not layer.k.any() and not layer.v.any()
    assert kv.layer(1).v.numel() == 0


def test_pages_for_budget():
    per_page = KVCache.bytes_per_page(LAYERS, 8, torch.bfloat16)
    assert pages_for_budget(7 * per_page + per_page - 1, LAYERS, 8, torch.bfloat16) == 7
    assert pages_for_budget(2 * per_page, LAYERS, 8, torch.bfloat16) == 2
    with pytest.raises(ValueError, match=f"needs {per_page} bytes"):
        pages_for_budget(2 * per_page - 1, LAYERS, 8, torch.bfloat16)
    with pytest.raises(ValueError):
        pages_for_budget(10**9, [KVLayerSpec(2, 0, 0)], 8, torch.bfloat16)


def test_copy_pages_copies_exactly_the_named_pages_in_every_layer(seed):
    """E4M3 layers too (pages move as bytes: the CPU has no E4M3 index_copy_)."""
    kv = KVCache(LAYERS + OWN_TYPES, num_pages=8, page_size=4, dtype=torch.float32, device="cpu")
    for i in range(kv.num_layers):
        for t in (kv.layer(i).k, kv.layer(i).v):
            t.copy_(torch.randn(t.shape))
    before = [(kv.layer(i).k.clone(), kv.layer(i).v.clone()) for i in range(kv.num_layers)]
    src, dst = [3, 1, 5], [5, 2, 7]  # page 5 is read before it is overwritten
    kv.copy_pages(src, dst)
    for i, (k0, v0) in enumerate(before):
        expect_k, expect_v = k0.clone(), v0.clone()
        expect_k[dst], expect_v[dst] = k0[src], v0[src]
        for got, want in ((kv.layer(i).k, expect_k), (kv.layer(i).v, expect_v)):
            assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        assert not torch.equal(kv.layer(i).k[2].view(torch.uint8), k0[2].view(torch.uint8))  # it really moved data


def test_copy_pages_rejects_mismatched_or_repeated_destinations():
    kv = KVCache(LAYERS, num_pages=4, page_size=2, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError):
        kv.copy_pages([1, 2], [3])
    with pytest.raises(ValueError):
        kv.copy_pages([1, 2], [3, 3])
    kv.copy_pages([], [])
