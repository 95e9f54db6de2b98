"""Llama-family decoders: Llama 3.x, and Qwen3 (Llama with per-head q/k RMSNorm).

Q, K and V are one fused projection and gate/up another; the loader writes the checkpoint's
separate tensors into their row ranges.
"""

from __future__ import annotations

import re
from typing import Iterable

import torch
from torch import nn

from ..config import ModelConfig
from ..distributed.layers import (ColumnParallelLinear, ParallelLMHead, RowParallelLinear, VocabParallelEmbedding,
                                  head_chunks, split)
from ..families.attention import AttentionLayer, QKNorm
from ..families.norm import NormBackend
from ..forward import ForwardBatch
from ..kv.storage import KVCache, KVLayerSpec
from ..native.rope import RotaryEmbedding, rope_from_hf
from .base import Backends, CausalLM
from .block_fp8 import SCALE, BlockFP8Weights, check_config, resolve_scale
from .layers import RMSNorm
from .weights import Target, checkpoint_part, load_into


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, backends: Backends, rope: RotaryEmbedding,
                 qk_norm: bool, sliding_window: int | None, *, dtype: torch.dtype, device) -> None:
        super().__init__()
        hf = config.hf
        hidden, tp = hf["hidden_size"], backends.tp
        heads = hf["num_attention_heads"]
        kv_heads = hf.get("num_key_value_heads") or heads
        self.head_dim = hf.get("head_dim") or hidden // heads
        # heads split over the tensor-parallel ranks; KV heads replicated where there are fewer than ranks
        kv_chunks = head_chunks(kv_heads, tp, "num_key_value_heads")
        self.num_heads = split(heads, tp.size, "num_attention_heads")
        self.num_kv_heads = kv_heads // kv_chunks
        q, kv = heads * self.head_dim, kv_heads * self.head_dim
        bias = bool(hf.get("attention_bias", False))
        self.qkv_proj = ColumnParallelLinear(hidden, {"q": (q, tp.size), "k": (kv, kv_chunks), "v": (kv, kv_chunks)},
                                             backends.linear, tp, bias=bias, dtype=dtype, device=device)
        self.o_proj = RowParallelLinear(q, hidden, backends.linear, tp, bias=bias, dtype=dtype, device=device)
        eps = hf.get("rms_norm_eps", 1e-6)
        # the per-head q/k norms hold their checkpoint weights; the attention backend applies them
        self.q_norm = RMSNorm(self.head_dim, eps, dtype=dtype, device=device) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps, dtype=dtype, device=device) if qk_norm else None
        self.rope = rope
        self.backend = backends.attention
        self.spec = AttentionLayer(layer_id=layer_id, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                                   head_dim=self.head_dim, scale=self.head_dim**-0.5, sliding_window=sliding_window)
        self.sizes = tuple(rows for _, rows in self.qkv_proj.shards.values())

    def norm_forward(self, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm, batch: ForwardBatch,
                     kv: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of norm(x + residual), and that sum; the norm runs with the QKV projection."""
        qkv, residual = norm.add_linear(x, residual, self.qkv_proj)
        q, k, v = qkv.split(self.sizes, dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        qk_norm = None if self.q_norm is None else QKNorm(self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        out = self.backend.rope_forward(q, k, v, self.rope, batch.positions, kv.layer(self.spec.layer_id), self.spec,
                                        batch, qk_norm=qk_norm)
        return self.o_proj(out.reshape(x.shape[0], -1)), residual


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, backends: Backends, *, dtype: torch.dtype, device) -> None:
        super().__init__()
        tp = backends.tp
        self.gate_up_proj = ColumnParallelLinear(hidden, {"gate": (intermediate, tp.size), "up": (intermediate, tp.size)},
                                                 backends.linear, tp, dtype=dtype, device=device)
        self.down_proj = RowParallelLinear(intermediate, hidden, backends.linear, tp, dtype=dtype, device=device)

    def norm_forward(self, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm,
                     batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The MLP of norm(x + residual), and that sum; the norm runs with the gate/up projection."""
        h, residual = norm.add_linear(x, residual, self.gate_up_proj, silu_mul=True)
        return self.down_proj(h), residual


class DecoderLayer(nn.Module):
    def __init__(self, attn: Attention, mlp: nn.Module, hidden: int, eps: float, ops: NormBackend, *, dtype,
                 device) -> None:
        super().__init__()
        self.self_attn = attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden, eps, dtype=dtype, device=device, ops=ops)
        self.post_attention_layernorm = RMSNorm(hidden, eps, dtype=dtype, device=device, ops=ops)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch,
                kv: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.self_attn.norm_forward(x, residual, self.input_layernorm, batch, kv)
        return self.mlp.norm_forward(h, residual, self.post_attention_layernorm, batch)


class Decoder(nn.Module):
    def __init__(self, layers: list[DecoderLayer], vocab: int, hidden: int, eps: float, backends: Backends, *,
                 dtype, device) -> None:
        super().__init__()
        ops = backends.norm
        self.embed_tokens = VocabParallelEmbedding(vocab, hidden, backends.tp, dtype=dtype, device=device)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(hidden, eps, dtype=dtype, device=device, ops=ops)

    def forward(self, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        x, residual = self.embed_tokens(batch.input_ids), None
        kept = []
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, batch, kv)
            if i in batch.feature_layers:
                kept.append(x + residual)
        if kept:
            batch.features["layers"] = torch.cat(kept, -1)
        return self.norm.add_forward(x, residual)[0]


_QKV = re.compile(r"(.*)\.self_attn\.([qkv])_proj\.(weight|bias)$")
_GATE_UP = re.compile(r"(.*)\.mlp\.(gate|up)_proj\.weight$")


class LlamaForCausalLM(CausalLM):
    qk_norm = False

    def __init__(self, config: ModelConfig, backends: Backends, device: torch.device | str = "cpu") -> None:
        super().__init__(config, backends)
        hf, dtype = config.hf, config.dtype
        self.fp8 = check_config(hf)  # the fine-grained FP8 layout (block_fp8.py); else unquantized
        hidden, eps = hf["hidden_size"], hf.get("rms_norm_eps", 1e-6)
        rope = rope_from_hf(hf, device=device)
        layers = [
            DecoderLayer(
                Attention(config, i, backends, rope, self.qk_norm, self.sliding_window(i), dtype=dtype, device=device),
                self.make_mlp(i, backends, dtype=dtype, device=device),
                hidden, eps, backends.norm, dtype=dtype, device=device,
            )
            for i in range(hf["num_hidden_layers"])
        ]
        self.model = Decoder(layers, config.vocab_size, hidden, eps, backends, dtype=dtype, device=device)
        self.lm_head = ParallelLMHead(hidden, config.vocab_size, backends.linear, backends.tp, dtype=dtype,
                                      device=device)
        self.tied = bool(hf.get("tie_word_embeddings", False))

    def sliding_window(self, layer_id: int) -> int | None:
        return None

    def make_mlp(self, layer_id: int, backends: Backends, *, dtype, device) -> nn.Module:
        return MLP(self.config.hf["hidden_size"], self.config.hf["intermediate_size"], backends,
                   dtype=dtype, device=device)

    def kv_layer_specs(self) -> list[KVLayerSpec]:
        return [KVLayerSpec(l.self_attn.num_kv_heads, l.self_attn.head_dim, l.self_attn.head_dim)
                for l in self.model.layers]

    def forward(self, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        return self.model(batch, kv)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)  # fp32

    def resolve(self, name: str) -> Target | None:
        """Checkpoint name -> parameter (and row range of a fused projection); an FP8 weight's
        scale goes beside it."""
        if self.fp8 and SCALE.match(name):
            return resolve_scale(self, name)
        if name.endswith("rotary_emb.inv_freq"):
            return None
        if name == "lm_head.weight" and self.tied:
            return None
        if m := _QKV.match(name):
            proj = self.get_submodule(f"{m[1]}.self_attn.qkv_proj")
            return Target(f"{m[1]}.self_attn.qkv_proj.{m[3]}", proj.shards[m[2]], part=proj.parts[m[2]])
        if m := _GATE_UP.match(name):
            proj = self.get_submodule(f"{m[1]}.mlp.gate_up_proj")
            return Target(f"{m[1]}.mlp.gate_up_proj.weight", proj.shards[m[2]], part=proj.parts[m[2]])
        return Target(name)

    def checkpoint_part(self, name: str) -> tuple[int, int, int] | bool | None:
        part = checkpoint_part(self, self.resolve, name)
        # FP8 weights are read whole: a rank's rows need not start on a scale block, and the
        # weights dequantized at load are cut to the rank's part only after (load_into)
        return None if self.fp8 and part is not False else part

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        shared = {"lm_head.weight": "model.embed_tokens.weight"} if self.tied else None
        fp8 = None
        if self.fp8:
            moe = self.backends.moe.schemes if self.backends.moe is not None else ()
            fp8 = BlockFP8Weights(self, self.config.quantization != "none", self.config.dtype, moe)
            weights = fp8(weights)
        with torch.no_grad():
            load_into(self, weights, self.resolve, shared)
        if fp8 is not None:
            fp8.log()


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True

    def sliding_window(self, layer_id: int) -> int | None:
        hf = self.config.hf
        types = hf.get("layer_types")
        if hf.get("use_sliding_window") and types and types[layer_id] == "sliding_attention":
            return hf.get("sliding_window")
        return None
