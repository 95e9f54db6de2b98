"""The tensors of a checkpoint, named and shaped as HF's model classes (and published files) have them.

Qwen3-MoE experts are written one tensor per expert and projection, as the published checkpoints
are; transformers 5 fuses them on load.
"""

from __future__ import annotations

import math
from typing import Any

Shapes = list[tuple[str, tuple[int, ...]]]

_QK_NORM = {"LlamaForCausalLM": False, "Qwen3ForCausalLM": True, "Qwen3MoeForCausalLM": True}


def _mlp(prefix: str, hidden: int, intermediate: int) -> Shapes:
    return [(f"{prefix}.gate_proj.weight", (intermediate, hidden)),
            (f"{prefix}.up_proj.weight", (intermediate, hidden)),
            (f"{prefix}.down_proj.weight", (hidden, intermediate))]


def _is_sparse(config: dict[str, Any], layer: int) -> bool:
    """Qwen3-MoE's rule for which layers route to experts."""
    return (config.get("num_experts", 0) > 0 and layer not in config.get("mlp_only_layers", [])
            and (layer + 1) % config.get("decoder_sparse_step", 1) == 0)


def tensor_shapes(config: dict[str, Any]) -> Shapes:
    """(name, shape) of every tensor of the checkpoint ``config`` describes, in module order."""
    arch = (config.get("architectures") or [None])[0]
    if arch not in _QK_NORM:
        raise ValueError(f"the generator writes {', '.join(_QK_NORM)}; got architectures={config.get('architectures')}")
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise ValueError("the generator writes bias-free projections; set attention_bias and mlp_bias to false")
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    shapes: Shapes = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        shapes += [(f"{p}.self_attn.q_proj.weight", (heads * head_dim, hidden)),
                   (f"{p}.self_attn.k_proj.weight", (kv_heads * head_dim, hidden)),
                   (f"{p}.self_attn.v_proj.weight", (kv_heads * head_dim, hidden)),
                   (f"{p}.self_attn.o_proj.weight", (hidden, heads * head_dim))]
        if _QK_NORM[arch]:
            shapes += [(f"{p}.self_attn.q_norm.weight", (head_dim,)), (f"{p}.self_attn.k_norm.weight", (head_dim,))]
        if _is_sparse(config, i):
            shapes.append((f"{p}.mlp.gate.weight", (config["num_experts"], hidden)))
            for e in range(config["num_experts"]):
                shapes += _mlp(f"{p}.mlp.experts.{e}", hidden, config["moe_intermediate_size"])
        else:
            shapes += _mlp(f"{p}.mlp", hidden, config["intermediate_size"])
        shapes += [(f"{p}.input_layernorm.weight", (hidden,)), (f"{p}.post_attention_layernorm.weight", (hidden,))]
    shapes.append(("model.norm.weight", (hidden,)))
    if not config.get("tie_word_embeddings", False):
        shapes.append(("lm_head.weight", (vocab, hidden)))
    return shapes


def parameter_count(config: dict[str, Any]) -> int:
    return sum(math.prod(shape) for _, shape in tensor_shapes(config))
