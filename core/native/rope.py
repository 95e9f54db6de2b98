"""Rotary position embeddings with HF's frequencies ("default", "llama3", "yarn") and rounding.

The inverse frequencies repeat HF's fp32 arithmetic step by step and cos/sin are rounded to the
activation dtype before the rotation, as HF does, so rotated q/k match HF bit for bit.
"""

from __future__ import annotations

import math

import torch

ROPE_TYPES = ("default", "llama3", "yarn")


def _default_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3_inv_freq(base: float, dim: int, p: dict) -> torch.Tensor:
    """Llama 3.1: long wavelengths slowed by ``factor``, short ones kept, a smooth ramp between."""
    inv_freq = _default_inv_freq(base, dim)
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(base: float, dim: int, max_position: int, p: dict) -> tuple[torch.Tensor, float]:
    """YaRN: interpolated low frequencies, extrapolated high ones, and the cos/sin factor mscale."""
    original = p["original_max_position_embeddings"]
    factor = p.get("factor") or max_position / original
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


class RotaryEmbedding:
    """Rotates the first ``rotary_dim`` channels of every head by its token's absolute position.

    ``scaling``: HF rope parameters beyond the base (``rope_type`` and its keys), None for plain
    RoPE. ``is_neox_style``: rotate the two halves (HF Llama ``rotate_half``); otherwise rotate
    adjacent pairs (interleaved, GPT-J / DeepSeek-V4). The cos/sin cache covers positions
    0..max_position-1 and already carries the attention factor (YaRN's mscale).
    """

    def __init__(self, head_dim: int, rotary_dim: int, max_position: int, base: float, scaling: dict | None,
                 is_neox_style: bool = True, dtype: torch.dtype = torch.float32, device=None) -> None:
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise ValueError(f"rotary_dim {rotary_dim} must be even and in 1..head_dim ({head_dim})")
        p = dict(scaling or {})
        rope_type = p.get("rope_type") or p.get("type") or "default"
        p.setdefault("original_max_position_embeddings", max_position)
        if rope_type == "default":
            inv_freq, attention_factor = _default_inv_freq(base, rotary_dim), 1.0
        elif rope_type == "llama3":
            inv_freq, attention_factor = _llama3_inv_freq(base, rotary_dim, p), 1.0
        elif rope_type == "yarn":
            inv_freq, attention_factor = _yarn(base, rotary_dim, max_position, p)
        else:
            raise ValueError(f"rope type {rope_type!r} is not supported; supported: {ROPE_TYPES}")
        self.head_dim, self.rotary_dim, self.max_position = head_dim, rotary_dim, max_position
        self.is_neox_style = is_neox_style
        self.rope_type = rope_type
        self.attention_factor = attention_factor
        self.inv_freq = inv_freq.to(device)
        freqs = torch.arange(max_position, dtype=torch.float32, device=device)[:, None] * self.inv_freq
        self.cos = (freqs.cos() * attention_factor).to(dtype)  # [max_position, rotary_dim // 2]
        self.sin = (freqs.sin() * attention_factor).to(dtype)

    def apply(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, D], k [T, Hk, D], positions [T] -> rotated (q, k) in their dtypes."""
        cos, sin = self.cos[positions][:, None, :], self.sin[positions][:, None, :]
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        if self.is_neox_style:
            x1, x2 = rot.chunk(2, dim=-1)
            out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out


def rope_from_hf(hf_config: dict, layer_type: str | None = None, device=None) -> RotaryEmbedding:
    """The rotary embedding an HF ``config.json`` describes.

    Reads the transformers-5 ``rope_parameters`` (flat, or nested per ``layer_type``) or the older
    ``rope_theta`` + ``rope_scaling``, and ``partial_rotary_factor``, ``head_dim``,
    ``max_position_embeddings`` (a top-level ``original_max_position_embeddings`` wins, as in HF).
    """
    hf = hf_config
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    if layer_type is not None:
        params = dict(params[layer_type])
    elif any(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"rope_parameters are per layer type ({sorted(params)}); name the layer_type")
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    partial = params.pop("partial_rotary_factor", None) or hf.get("partial_rotary_factor") or 1.0
    base = params.pop("rope_theta", None) or hf.get("rope_theta") or 10000.0
    max_position = hf["max_position_embeddings"]
    if "original_max_position_embeddings" in hf:
        params["original_max_position_embeddings"] = hf["original_max_position_embeddings"]
    return RotaryEmbedding(head_dim, int(head_dim * partial), max_position, float(base), params or None,
                           device=device)
