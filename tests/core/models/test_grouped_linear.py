"""DeepSeek-V4's grouped output projection (wo_a) on MXFP8: the weight's requantization is exact for
the published FP8 weights, MXFP8 activations regroup by whole blocks, and the native linear
multiplies them as the definition says (dequantize both, multiply)."""

from __future__ import annotations

import pytest
import torch

from engine.core.distributed.group import SINGLE
from engine.core.distributed.layers import RowParallelLinear
from engine.core.families.linear import MXFP8Tensor
from engine.core.models.deepseek_v4.attention import GroupedLinear
from engine.core.native import quant
from engine.core.native.linear import NativeLinear


def grouped(weight: torch.Tensor, groups: int) -> GroupedLinear:
    layer = GroupedLinear(weight.shape[1], weight.shape[0] // groups, groups, NativeLinear(None), dtype=weight.dtype,
                          device="cpu")
    layer.weight.data.copy_(weight)
    return layer


def test_keep_mxfp8_is_exact_for_published_fp8_weights(seed):
    """Weights dequantized from E4M3 with E8M0 scales on 128 x 128 blocks (values of every magnitude)
    come back from MXFP8 equal to the bit."""
    w = torch.randn(256, 384) * torch.exp(4 * torch.randn(256, 1))
    data, scale = quant.quantize_fp8_block_e8m0(w)
    published = quant.dequantize_fp8_block_e8m0(data, scale, dtype=torch.float32)
    layer = grouped(published, 2)
    layer.keep_mxfp8()
    assert layer.weight.dtype == quant.FP8 and layer.weight_scale.shape == (256, 384 // 32)
    assert torch.equal(quant.dequantize_mxfp8(layer.weight, layer.weight_scale), published)


def test_mxfp8_activations_regroup_and_multiply_as_dequantized(seed):
    """[T, H, D] as attention writes it, regrouped to [T, G, H * D / G]: the same values, and the
    projection of them (both halves) the dequantized product, then wo_b."""
    t, heads, head_dim, groups, rank = 5, 4, 64, 2, 48
    data, scale = quant.quantize_mxfp8(torch.randn(t, heads, head_dim))
    o = MXFP8Tensor(data, scale, torch.float32)
    regrouped = o.reshape(t, groups, -1)
    assert torch.equal(regrouped.dequantize(), o.dequantize().reshape(t, groups, -1))
    layer = grouped(torch.randn(groups * rank, heads * head_dim // groups) * 0.05, groups)
    wo_b = RowParallelLinear(groups * rank, 32, NativeLinear(None), SINGLE, dtype=torch.float32, device="cpu")
    wo_b.weight.data.copy_(torch.randn(32, groups * rank) * 0.1)
    with pytest.raises(ValueError, match="keep_mxfp8"):
        layer(regrouped, wo_b)
    layer.keep_mxfp8()
    w = quant.dequantize_mxfp8(layer.weight, layer.weight_scale).view(groups, rank, -1)
    want = torch.einsum("tgk,grk->tgr", regrouped.dequantize(), w).reshape(t, -1) @ wo_b.weight.T
    torch.testing.assert_close(layer(regrouped, wo_b), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="split blocks"):
        o.reshape(t, -1, 16)


def test_a_rank_whose_rows_cut_a_block_does_not_keep_fp8_blocks():
    """Under tensor parallelism a rank holds its groups' rows of wo_a: V4.1's 32-row scale blocks stay
    whole only where those rows fill them."""
    for rows, ranks, splits in ((8, 2, True), (64, 2, False), (8, 1, False)):
        layer = GroupedLinear(32, rows // 2, 2, NativeLinear(None), dtype=torch.float32, device="cpu")
        layer.weight.partition = (0, 0, ranks)
        assert layer.splits_blocks(32) == splits
