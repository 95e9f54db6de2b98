"""The shapes the generator knows: published configs of real models, and small ones for tests.

Field names are the ones transformers 5 writes (``rope_parameters``; Qwen3-MoE's expert count as
both the published ``num_experts`` and transformers 5's ``num_local_experts``). The special token
ids are the embedded tokenizer's, which every preset shares; the large presets keep their real
vocabulary sizes and simply never see the ids above the tokenizer's.
"""

from __future__ import annotations

from typing import Any

from .tokenizer import SPECIAL_IDS, TOKENIZER_SIZE

_COMMON = {"attention_bias": False, "attention_dropout": 0.0, "hidden_act": "silu", "initializer_range": 0.02,
           "use_cache": True, **SPECIAL_IDS}


def _llama(**dims: Any) -> dict[str, Any]:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **_COMMON, "mlp_bias": False,
            "pretraining_tp": 1, "rms_norm_eps": 1e-5, **dims}


def _llama3_rope(original_max_position_embeddings: int) -> dict[str, Any]:
    return {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": original_max_position_embeddings}


def _qwen3(**dims: Any) -> dict[str, Any]:
    return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **_COMMON, "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}, "use_sliding_window": False,
            "sliding_window": None, "max_window_layers": dims["num_hidden_layers"], **dims}


def _qwen3_moe(num_experts: int, **dims: Any) -> dict[str, Any]:
    return {**_qwen3(**dims), "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
            "num_experts": num_experts, "num_local_experts": num_experts, "decoder_sparse_step": 1,
            "mlp_only_layers": [], "norm_topk_prob": True, "output_router_logits": False,
            "router_aux_loss_coef": 0.001}


PRESETS: dict[str, dict[str, Any]] = {
    "default": _qwen3(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=64, vocab_size=TOKENIZER_SIZE, tie_word_embeddings=True,
                      max_position_embeddings=4096),
    "qwen3-0.6b": _qwen3(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                         num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                         max_position_embeddings=40960),
    "llama-3.1-8b": _llama(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                           num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False,
                           max_position_embeddings=131072, rope_parameters=_llama3_rope(8192)),
    "qwen3-30b-a3b": _qwen3_moe(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                                hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                                num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
                                tie_word_embeddings=False, max_position_embeddings=40960),
    "tiny-llama": _llama(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=TOKENIZER_SIZE, tie_word_embeddings=False,
                         max_position_embeddings=2048, rope_parameters=_llama3_rope(256)),
    "tiny-qwen3-moe": _qwen3_moe(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, hidden_size=64,
                                 intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=16, vocab_size=TOKENIZER_SIZE,
                                 tie_word_embeddings=False, max_position_embeddings=2048),
}
