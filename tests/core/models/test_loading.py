"""Loading checkpoints: dtypes, shards, tied embeddings, and errors that say what is wrong."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.checkpoints import write_checkpoint
from engine.core.config import EngineConfig
from engine.core.kv.storage import KVCache, pages_for_budget
from engine.core.models.weights import WeightLoadError
from engine.core.registry import SelectionError
from engine.core.startup import build


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "llama", "tiny-llama", dtype=torch.float32,
                            progress=False)


def copy_of(src, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(src, dst)
    return dst


def load(path, **kw):
    return build(EngineConfig(model=str(path), num_pages=8, **kw), progress=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dtypes_load_and_match_the_checkpoint(llama_dir, dtype):
    c = load(llama_dir, dtype=str(dtype).removeprefix("torch."))
    assert all(p.dtype == dtype for p in c.model.parameters())
    assert c.kv.layer(0).k.dtype == dtype
    ref = load_file(str(llama_dir / "model.safetensors"))["model.layers.1.mlp.down_proj.weight"]
    assert torch.equal(c.model.model.layers[1].mlp.down_proj.weight, ref.to(dtype))


def test_sharded_checkpoint_and_fused_projections(tmp_path, seed):
    path = write_checkpoint(tmp_path / "s", "tiny-qwen3-moe", dtype=torch.float32, seed=seed,
                            shard_bytes=200_000, progress=False)
    assert (path / "model.safetensors.index.json").is_file()
    c = load(path, dtype="float32")
    shards = [load_file(str(f)) for f in sorted(path.glob("model-*.safetensors"))]
    tensors = {k: v for s in shards for k, v in s.items()}
    attn = c.model.model.layers[0].self_attn
    q, k, v = attn.qkv_proj.weight.split(attn.sizes)
    assert torch.equal(k, tensors["model.layers.0.self_attn.k_proj.weight"])
    experts = c.model.model.layers[1].mlp.experts
    inter = experts.inter
    assert torch.equal(experts.gate_up[5, inter:], tensors["model.layers.1.mlp.experts.5.up_proj.weight"])
    assert torch.equal(experts.down[3], tensors["model.layers.1.mlp.experts.3.down_proj.weight"])


def test_tied_embeddings_share_storage(tmp_path):
    path = write_checkpoint(tmp_path / "d", "default", dtype=torch.float32, progress=False)
    c = load(path, dtype="float32")
    assert c.model.lm_head.weight.data_ptr() == c.model.model.embed_tokens.weight.data_ptr()


def test_missing_files_are_named(llama_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load(tmp_path / "nowhere")
    d = copy_of(llama_dir, tmp_path)
    (d / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load(d)
    (d / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load(d)


def test_unknown_architecture_lists_the_known_ones(llama_dir, tmp_path):
    d = copy_of(llama_dir, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["MysteryForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SelectionError, match="MysteryForCausalLM.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        load(d)


def test_shape_mismatch_names_the_tensor(llama_dir, tmp_path):
    d = copy_of(llama_dir, tmp_path)
    tensors = load_file(str(d / "model.safetensors"))
    tensors["model.layers.1.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.up_proj.weight"][:-1].contiguous()
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(WeightLoadError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load(d)


def test_missing_tensor_is_named(llama_dir, tmp_path):
    d = copy_of(llama_dir, tmp_path)
    tensors = load_file(str(d / "model.safetensors"))
    del tensors["model.layers.0.post_attention_layernorm.weight"]
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(WeightLoadError, match="post_attention_layernorm"):
        load(d)


def test_kv_cache_is_sized_from_the_memory_budget(llama_dir):
    budget = 3 * 2**20
    c = build(EngineConfig(model=str(llama_dir), dtype="float32", kv_cache_memory=budget, page_size=8,
                           max_num_seqs=256), progress=False)
    specs = c.model.kv_layer_specs()
    assert c.kv.num_pages == pages_for_budget(budget, specs, 8, torch.float32)
    assert c.kv.num_pages * KVCache.bytes_per_page(specs, 8, torch.float32) <= budget
