"""RMSNorm, weighted and unweighted, bit for bit against HF's Llama / Qwen3 / DeepSeek-V4 norms."""

from __future__ import annotations

import pytest
import torch
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RMSNorm, DeepseekV4UnweightedRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from engine.core.native.norm import add_rms_norm, rms_norm, unweighted_rms_norm


def hf_norm(cls, weight, eps):
    norm = cls(weight.shape[0], eps=eps).to(weight.dtype)
    norm.weight.data.copy_(weight)
    return norm


@pytest.mark.parametrize("cls", [LlamaRMSNorm, Qwen3RMSNorm])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_hf_bitwise(seed, cls, dtype):
    x = (torch.randn(3, 7, 96) * 4).to(dtype)
    weight = (1 + torch.randn(96) * 0.3).to(dtype)
    out = rms_norm(x, weight, 1e-6)
    assert out.dtype == dtype
    with torch.no_grad():
        torch.testing.assert_close(out, hf_norm(cls, weight, 1e-6)(x), rtol=0, atol=0)


def test_fp32_weight_on_bf16_matches_deepseek_v4_bitwise(seed):
    x, weight = torch.randn(5, 64).bfloat16(), 1 + torch.randn(64) * 0.3
    with torch.no_grad():
        expected = hf_norm(DeepseekV4RMSNorm, weight, 1e-6)(x)
    out = rms_norm(x, weight, 1e-6)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unweighted_matches_deepseek_v4_bitwise(seed, dtype):
    """The per-head q norm: the reciprocal root rounded to x's dtype before the product."""
    q = (torch.randn(3, 4, 64) * 4).to(dtype)
    out = unweighted_rms_norm(q, 1e-6)
    assert out.dtype == dtype
    torch.testing.assert_close(out, DeepseekV4UnweightedRMSNorm(eps=1e-6)(q), rtol=0, atol=0)


def test_bf16_weight_order_matters(seed):
    """Multiplying before the cast back would differ from HF in bf16: the test above can tell."""
    x, weight = torch.randn(64, 256).bfloat16(), (1 + torch.randn(256) * 0.3).bfloat16()
    h = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    assert not torch.equal(rms_norm(x, weight, 1e-6), (weight.float() * h).bfloat16())


def test_add_rms_norm(seed):
    x, residual = torch.randn(4, 32).bfloat16(), torch.randn(4, 32).bfloat16()
    weight = torch.randn(32).bfloat16()
    normed, new_residual = add_rms_norm(x, residual, weight, 1e-5)
    torch.testing.assert_close(new_residual, residual + x, rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(normed, hf_norm(LlamaRMSNorm, weight, 1e-5)(residual + x), rtol=0, atol=0)
