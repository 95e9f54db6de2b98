"""core/models/deepseek_v4/publish.py: tiny-dsv4-py written in the published quantized layout loads
through checkpoint.py's reader with its weights resident as FP8 and FP4, and generates."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine import LLM, SamplingParams
from engine.core.models.deepseek_v4.publish import weight_format, write_published
from engine.core.models.weights import resident_bytes


@pytest.fixture(scope="module")
def published(shared_dir, tmp_path_factory, run_seed):
    """tiny-dsv4-py in two shards with an index (as save_pretrained writes a large model), published."""
    tiny, root = shared_dir / "models" / "tiny-dsv4-py", tmp_path_factory.mktemp("published")
    src, dst = root / "tiny-dsv4-two-shards", root / "tiny-dsv4-fp8-fp4"
    src.mkdir()
    for f in tiny.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, src / f.name)
    with safe_open(str(tiny / "model.safetensors"), framework="pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys()}
    names = sorted(tensors)
    random.Random(run_seed).shuffle(names)
    shards = {f"model-0000{i + 1}-of-00002.safetensors": names[i::2] for i in range(2)}
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, str(src / file))
    (src / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: file for file, part in shards.items() for n in part}}))
    return src, dst, write_published(src, dst), tensors


def test_layout_names_and_counts(published):
    src, dst, counts, tensors = published
    kinds = [weight_format(n) for n in tensors]
    assert counts["fp8"] == kinds.count("fp8") > 0 and counts["fp4"] == kinds.count("fp4") > 0
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {p.name for p in dst.glob("*.safetensors")} == \
        {p.name for p in src.glob("*.safetensors")}
    written = {}
    for shard in dst.glob("*.safetensors"):
        with safe_open(str(shard), framework="pt") as f:
            written |= {n: f.get_tensor(n) for n in f.keys()}
            assert all(index["weight_map"][n] == shard.name for n in f.keys())
    assert written.keys() == index["weight_map"].keys()
    assert {"embed.weight", "norm.weight", "hc_head_fn"} <= written.keys()
    assert not any(n.startswith("model.") for n in written)
    expert = next(n for n in written if weight_format(n) == "fp4")
    assert written[expert].dtype == written[expert.removesuffix(".weight") + ".scale"].dtype == torch.uint8
    assert json.loads((dst / "config.json").read_text())["quantization_config"]["weight_block_size"] == [128, 128]
    assert counts["bytes"] == sum(p.stat().st_size for p in dst.glob("*.safetensors")) - _headers(dst)


def _headers(path) -> int:
    """Bytes of the safetensors headers (8-byte length and JSON) in path's shards."""
    total = 0
    for p in path.glob("*.safetensors"):
        with open(p, "rb") as f:
            total += 8 + int.from_bytes(f.read(8), "little")
    return total


def test_loads_resident_in_fp8_and_fp4_and_generates(published, seed):
    src, dst, _, _ = published
    quantized, dense = (LLM(str(p), device="cpu", dtype="float32", progress=False) for p in (dst, src))
    params = dict(quantized.engine.components.model.named_parameters())
    assert params["model.layers.0.attn.wq_a.weight"].dtype == torch.float8_e4m3fn
    assert params["model.layers.0.ffn.experts.gate_up"].dtype == torch.uint8
    held, weights = resident_bytes(quantized.engine.components.model)
    dense_held, dense_weights = resident_bytes(dense.engine.components.model)
    assert weights == dense_weights and held < 0.5 * dense_held
    prompts = [[random.randrange(100, 4000) for _ in range(random.randint(2, 40))] for _ in range(2)]
    outs = quantized.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4]


def test_refuses_a_checkpoint_without_v4_names(tmp_path, shared_dir):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text((shared_dir / "models" / "tiny-dsv4-py" / "config.json").read_text())
    save_file({"model.layers.0.mlp.gate_proj.weight": torch.randn(4, 4)}, str(src / "model.safetensors"))
    with pytest.raises(ValueError, match="0 attention/shared-expert linears and 0 routed expert weights"):
        write_published(src, tmp_path / "dst")
