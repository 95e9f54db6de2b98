"""RoPE frequencies, attention factor and rotation against HF transformers."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.deepseek_v4.modeling_deepseek_v4 import apply_rotary_pos_emb as v4_apply_rotary
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from engine.core.native.rope import RotaryEmbedding, rope_from_hf

HEAD_DIM, HIDDEN, HEADS, MAX_POS = 64, 256, 4, 4096

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 512}
YARN = {
    "plain": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
    "deepseek": {"rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.707,
                 "beta_fast": 32, "beta_slow": 1, "original_max_position_embeddings": 128},
    "attention_factor": {"rope_type": "yarn", "factor": 2.0, "attention_factor": 1.3, "beta_fast": 16,
                         "beta_slow": 2, "original_max_position_embeddings": 2048},
    "no_truncate": {"rope_type": "yarn", "factor": 8.0, "truncate": False, "original_max_position_embeddings": 512},
}


def hf_config(params: dict, theta: float = 10000.0, **kw) -> LlamaConfig:
    return LlamaConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, head_dim=HEAD_DIM, max_position_embeddings=MAX_POS,
                       rope_parameters={**params, "rope_theta": theta}, **kw)


def ours(params: dict | None, theta: float = 10000.0, rotary_dim: int = HEAD_DIM, **kw) -> RotaryEmbedding:
    return RotaryEmbedding(HEAD_DIM, rotary_dim, MAX_POS, theta, params, **kw)


@pytest.mark.parametrize("name, params", [("llama3", LLAMA3), *[(f"yarn_{k}", v) for k, v in YARN.items()]])
def test_inv_freq_and_attention_factor_match_hf(name, params):
    inv_freq, factor = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf_config(params, theta=5e5))
    rope = ours(params, theta=5e5)
    torch.testing.assert_close(rope.inv_freq, inv_freq, rtol=0, atol=0)
    assert rope.attention_factor == pytest.approx(factor, rel=1e-12)
    if name != "llama3":
        assert rope.attention_factor != 1.0


def test_partial_rotary_yarn_matches_hf():
    params = {**YARN["plain"], "partial_rotary_factor": 0.5}
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config(params))
    rope = ours(params, rotary_dim=HEAD_DIM // 2)
    assert rope.inv_freq.shape == (HEAD_DIM // 4,)
    torch.testing.assert_close(rope.inv_freq, inv_freq, rtol=0, atol=0)


def test_default_matches_hf():
    inv_freq, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(hf_config({"rope_type": "default"}))
    torch.testing.assert_close(ours(None).inv_freq, inv_freq, rtol=0, atol=0)


def hf_rotate(q, k, positions, config, dtype):
    """HF Llama: cos/sin from LlamaRotaryEmbedding, rotation by apply_rotary_pos_emb on [1, H, T, D]."""
    emb = LlamaRotaryEmbedding(config)
    cos, sin = emb(q.to(dtype), positions[None])
    hq, hk = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    return hq[0].transpose(0, 1), hk[0].transpose(0, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("params", [{"rope_type": "default"}, LLAMA3, YARN["deepseek"]],
                         ids=["default", "llama3", "yarn"])
def test_rotation_matches_hf_llama_bitwise(seed, dtype, params):
    t = 37
    q, k = torch.randn(t, 4, HEAD_DIM).to(dtype), torch.randn(t, 2, HEAD_DIM).to(dtype)
    positions = torch.randint(0, MAX_POS, (t,))
    config = hf_config(params)
    rope = ours(None if params["rope_type"] == "default" else params)
    rq, rk = rope.apply(q, k, positions)
    hq, hk = hf_rotate(q, k, positions, config, dtype)
    assert rq.dtype == dtype and rk.dtype == dtype
    torch.testing.assert_close(rq, hq, rtol=0, atol=0)
    torch.testing.assert_close(rk, hk, rtol=0, atol=0)


def test_partial_rotary_leaves_the_tail(seed):
    rd = 16
    q, k = torch.randn(9, 4, HEAD_DIM), torch.randn(9, 1, HEAD_DIM)
    positions = torch.arange(100, 109)
    rope = ours(None, rotary_dim=rd)
    rq, rk = rope.apply(q, k, positions)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rd, 2).float() / rd))
    freqs = torch.cat([positions[:, None].float() * inv_freq] * 2, dim=-1)
    cos, sin = freqs.cos()[None], freqs.sin()[None]
    hq, hk = apply_rotary_pos_emb(q[..., :rd].transpose(0, 1)[None], k[..., :rd].transpose(0, 1)[None], cos, sin)
    torch.testing.assert_close(rq[..., :rd], hq[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(rk[..., :rd], hk[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
    assert torch.equal(rq[..., rd:], q[..., rd:]) and torch.equal(rk[..., rd:], k[..., rd:])


def test_interleaved_is_complex_rotation_of_pairs(seed):
    q, k = torch.randn(11, 4, HEAD_DIM), torch.randn(11, 2, HEAD_DIM)
    positions = torch.randint(0, MAX_POS, (11,))
    rope = ours(YARN["plain"], is_neox_style=False)
    rq, rk = rope.apply(q, k, positions)
    angles = (positions[:, None].float() * rope.inv_freq).double()  # HF's fp32 angles
    rotor = torch.polar(torch.full_like(angles, rope.attention_factor), angles)[:, None, :]

    def rotate(x):
        return torch.view_as_real(torch.view_as_complex(x.double().unflatten(-1, (-1, 2)).contiguous()) * rotor
                                  ).flatten(-2).float()

    torch.testing.assert_close(rq, rotate(q), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rk, rotate(k), rtol=1e-5, atol=1e-5)
    # and HF DeepSeek-V4's interleaved rotation agrees (it rotates the whole head when rope_dim == head_dim)
    freqs = positions[:, None].float() * rope.inv_freq
    cos, sin = freqs.cos() * rope.attention_factor, freqs.sin() * rope.attention_factor
    torch.testing.assert_close(rq, v4_apply_rotary(q, cos, sin, unsqueeze_dim=1), rtol=1e-6, atol=1e-6)


def test_rope_from_hf_new_and_old_forms():
    new = {"hidden_size": HIDDEN, "num_attention_heads": HEADS, "max_position_embeddings": MAX_POS,
           "rope_parameters": {**LLAMA3, "rope_theta": 5e5}}
    old = {"hidden_size": HIDDEN, "num_attention_heads": HEADS, "max_position_embeddings": MAX_POS,
           "rope_theta": 5e5, "rope_scaling": {**{k: v for k, v in LLAMA3.items() if k != "rope_type"}, "type": "llama3"}}
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](LlamaConfig(**old))
    for hf in (new, old):
        rope = rope_from_hf(hf)
        assert rope.rope_type == "llama3" and rope.rotary_dim == HIDDEN // HEADS
        torch.testing.assert_close(rope.inv_freq, expected, rtol=0, atol=0)


def test_rope_from_hf_partial_head_dim_and_defaults():
    hf = {"hidden_size": HIDDEN, "num_attention_heads": HEADS, "head_dim": 48, "max_position_embeddings": 100,
          "partial_rotary_factor": 0.5, "rope_theta": 1e6}
    rope = rope_from_hf(hf)
    assert (rope.head_dim, rope.rotary_dim, rope.max_position, rope.rope_type) == (48, 24, 100, "default")
    torch.testing.assert_close(rope.inv_freq, 1.0 / (1e6 ** (torch.arange(0, 24, 2).float() / 24)))
    yarn = rope_from_hf({**hf, "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                                                   "partial_rotary_factor": 0.25},
                         "original_max_position_embeddings": 25})
    assert yarn.rotary_dim == 12
    config = LlamaConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, head_dim=48, max_position_embeddings=100,
                         rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                                          "partial_rotary_factor": 0.25, "original_max_position_embeddings": 25})
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    torch.testing.assert_close(yarn.inv_freq, inv_freq, rtol=0, atol=0)
    assert yarn.attention_factor == pytest.approx(factor)


def test_rope_from_hf_nested_by_layer_type():
    hf = {"hidden_size": HIDDEN, "num_attention_heads": HEADS, "max_position_embeddings": MAX_POS,
          "rope_parameters": {"main": {"rope_type": "default", "rope_theta": 1e4},
                              "compress": {"rope_type": "default", "rope_theta": 16.0}}}
    with pytest.raises(ValueError, match="layer_type"):
        rope_from_hf(hf)
    assert rope_from_hf(hf, layer_type="compress").inv_freq[1] == pytest.approx(16.0 ** (-2 / HEAD_DIM))


def test_unknown_rope_type():
    with pytest.raises(ValueError, match="not supported"):
        ours({"rope_type": "longrope"})
