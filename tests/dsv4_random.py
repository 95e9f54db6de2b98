"""Tiny random DeepSeek-V4 checkpoints, written by HF transformers (for tests anywhere under tests/)."""

from __future__ import annotations

import torch
import transformers


def random_checkpoint(path, seed: int, layer_types: list[str], mlp_layer_types: list[str], hc_mult: int,
                      window: int, csa_rate: int = 4, hca_rate: int = 16, yarn: bool = False,
                      moe_intermediate_size: int = 16):
    """A tiny random V4 written by HF's save_pretrained, every parameter perturbed away from its
    init (sinks, biases, position biases, gates are zeros or ones there) and a random hash table.
    Publishing it (FP4 experts, one scale per 32 along K) wants ``moe_intermediate_size`` 32."""
    torch.manual_seed(seed)
    cfg = transformers.DeepseekV4Config(
        vocab_size=128, hidden_size=32, moe_intermediate_size=moe_intermediate_size, num_hidden_layers=len(layer_types),
        num_attention_heads=2, head_dim=16, q_lora_rank=16, n_routed_experts=6, num_experts_per_tok=2,
        layer_types=layer_types, mlp_layer_types=mlp_layer_types, hc_mult=hc_mult, o_groups=2, o_lora_rank=8,
        index_n_heads=16, index_head_dim=8, index_topk=8, sliding_window=window, partial_rotary_factor=0.5,
        compress_rates={"compressed_sparse_attention": csa_rate, "heavily_compressed_attention": hca_rate},
        max_position_embeddings=1024, initializer_range=0.2, swiglu_limit=1.0, pad_token_id=None,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}
        if yarn else None)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if name.endswith("tid2eid"):
                t.copy_(torch.stack([torch.randperm(6)[:2] for _ in range(t.shape[0])]))
            elif name.endswith(("sinks", "position_bias", "base", "e_score_correction_bias", "hc_base")):
                t.normal_(0, 0.5)
            elif name.endswith(("scale", "hc_scale")) or "norm" in name:
                t.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return path
