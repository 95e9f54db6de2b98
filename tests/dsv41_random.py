"""Tiny random DeepSeek-V4.1 checkpoints (CSA2 ratios 1 and 2 beside V4's 0, 4 and 128, entries and
index keys shared across layers, the candidate filter), for tests anywhere under tests/. HF
transformers has no V4.1, so the model itself names and shapes the weights it is then loaded from."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.core.models.deepseek_v4.publish import shaped_model, unstacked_experts
from engine.core.spec.dspark.stages import StageDrafter


# head and indexer dims the Triton V4 attention has GPU configs for (v4_sparse_attention.SPARSE), at the same tiny size
KERNEL_SHAPE = {"head_dim": 64, "qk_rope_head_dim": 16, "index_head_dim": 32, "index_n_heads": 16}


def v41_config(ratios: list[int], kv_sources: list[int], index_sources: list[int], candidate: int | None = None,
               blocks: int = 0, block_size: int = 0, window: int = 8, top_k: int = 4, hc_mult: int = 2,
               engram: list[int] = (), moe_intermediate_size: int = 16, dspark: list[int] = ()) -> dict:
    """config.json of a tiny V4.1 in the published key layout (compress_ratios per layer, the
    sharing fields, Engram at the layers ``engram`` names (3-grams, 2 heads of 8, tables of about
    2 x 2 x 31 rows), DSpark stages reading the target layers ``dspark`` names, one per layer, as
    V4.1-Flash's three (blocks of 5, Markov rank 8, 4 routed experts of which 2 a token))."""
    stages = {"num_nextn_predict_layers": len(dspark), "dspark_block_size": 5, "dspark_target_layer_ids": list(dspark),
              "dspark_markov_rank": 8, "dspark_n_routed_experts": 4, "dspark_num_experts_per_tok": 2,
              "dspark_noise_token_id": 3} if dspark else {"num_nextn_predict_layers": 0}
    return {**stages,
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "dtype": "float32",
        "vocab_size": 128, "hidden_size": 32, "moe_intermediate_size": moe_intermediate_size, "num_hidden_layers": len(ratios),
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "qk_rope_head_dim": 8,
        "q_lora_rank": 16, "o_groups": 2, "o_lora_rank": 8, "n_routed_experts": 6, "num_experts_per_tok": 2,
        "n_shared_experts": 1, "num_hash_layers": 1, "scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5,
        "norm_topk_prob": True, "swiglu_limit": 1.0, "hc_mult": hc_mult, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
        "rms_norm_eps": 1e-6, "sliding_window": window, "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
        "max_position_embeddings": 1024, "index_n_heads": 4, "index_head_dim": 8, "index_topk": top_k,
        "compress_ratios": list(ratios), "kv_source_layer_ids": kv_sources, "index_source_layer_ids": index_sources,
        "candidate_source_layer_id": -1 if candidate is None else candidate, "candidate_topk_blocks": blocks,
        "candidate_block_size": block_size, "engram_layer_ids": list(engram), "engram_max_ngram_size": 3,
        "engram_n_heads": 2, "engram_head_dim": 8, "engram_vocab_size": 31, "engram_pad_token_id": 2,
    }


def random_v41_checkpoint(path: Path, seed: int, hf: dict, tokenizer: Path | None = None) -> Path:
    """``hf`` written with random weights (every parameter away from zero and one) under ``path``,
    beside ``tokenizer``'s tokenizer files (Engram's compression table reads them)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf))
    for name in ("tokenizer.json", "tokenizer_config.json") if tokenizer is not None else ():
        shutil.copy(tokenizer / name, path / name)
    model = shaped_model(path)
    gen = torch.Generator().manual_seed(seed)
    weights = _random(model.state_dict(), hf, gen)
    tensors = dict(unstacked_experts(weights, hf["n_routed_experts"]))
    if hf["num_nextn_predict_layers"]:  # the DSpark stages, named and shaped by the drafter that loads them
        drafter = StageDrafter(model)
        names = drafter.checkpoint_names()
        stages = {names[k]: v for k, v in _random(drafter.state_dict(), hf, gen).items()}
        tensors.update(unstacked_experts(stages, hf["dspark_n_routed_experts"]))
    save_file(tensors, str(path / "model.safetensors"))
    return path


def _random(state: dict[str, torch.Tensor], hf: dict, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """``state``'s tensors drawn at random: norms and scales near one, the rest around zero."""
    weights = {}
    for name, t in state.items():
        if name.endswith("tid2eid"):
            w = torch.stack([torch.randperm(hf["n_routed_experts"], generator=gen)[:hf["num_experts_per_tok"]]
                             for _ in range(t.shape[0])]).to(t.dtype)
        elif "norm" in name or name.endswith(("scale", "q_weight", "k_weight")):
            w = torch.rand(t.shape, generator=gen) + 0.5
        else:
            w = torch.randn(t.shape, generator=gen) * 0.3
        weights[name] = w.to(t.dtype).contiguous()
    return weights

