"""DeepSeek-V4.1's published quantized layout (quantization_config weight_block_size [32, 32],
scale_fmt ue8m0, expert_dtype fp4 inside it): a tiny random V4.1 with Engram written so loads with
each FP8 weight dequantized exactly as stored (32 x 32 blocks; Engram's tables one scale per 32 of a
row, kept so and dequantized as gathered), and serves."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from engine.core.config import EngineConfig
from engine.core.models.deepseek_v4.engram import Rows
from engine.core.models.deepseek_v4.publish import write_published
from engine.core.native.quant import FP8
from engine.core.startup import build
from dsv41_random import random_v41_checkpoint, v41_config
from packed_logits import engine_logits

TINY = dict(ratios=[0, 2, 2, 1, 1], kv_sources=[1, 3], index_sources=[1, 3, 4], candidate=3, blocks=2, block_size=2,
            engram=[0, 3], moe_intermediate_size=32)


def test_the_v41_layout_loads_each_fp8_weight_as_stored(tmp_path, seed, shared_dir):
    src = random_v41_checkpoint(tmp_path / "bf16", seed, v41_config(**TINY), shared_dir / "models" / "tiny-dsv4-py")
    dst = tmp_path / "published"
    counts = write_published(src, dst, block=32)
    assert counts["fp8"] > 0 and counts["fp4"] > 0
    assert json.loads((dst / "config.json").read_text())["quantization_config"] == {
        "quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32], "scale_fmt": "ue8m0",
        "expert_dtype": "fp4"}
    c = build(EngineConfig(model=str(dst), dtype="float32", page_size=4, num_pages=64), progress=False)
    checked = set()
    with safe_open(str(next(dst.glob("*.safetensors"))), framework="pt") as f:
        for name in f.keys():
            weight = name.removesuffix(".scale") + ".weight"
            if not name.endswith(".scale") or f.get_tensor(weight).dtype != FP8 or ".shared_experts." in name:
                continue  # (the shared expert lives in the experts' stack)
            data, scale = f.get_tensor(weight).float(), f.get_tensor(name).view(torch.uint8).float()
            rows = 1 if ".engram.embed." in name else 32
            n, k = data.shape
            factor = torch.exp2(scale - 127).repeat_interleave(rows, 0)[:n].repeat_interleave(32, 1)[:, :k]
            module = c.model.get_submodule("model." + weight.removesuffix(".weight"))
            loaded = module(torch.arange(n)) if isinstance(module, Rows) else module.weight  # a table: as gathered
            assert torch.equal(loaded.float(), data * factor), weight
            checked.add(weight.split(".", 2)[2])
    assert {"engram.embed.weight", "engram.wkv.weight", "attn.wq_a.weight", "attn.indexer.wq_b.weight"} <= checked
    table = c.model.model.layers[3].engram.embed
    assert table.weight.dtype == FP8 and table.weight_scale.shape == (table.weight.shape[0], 1)  # 8 wide rows
    logits = engine_logits(c, [[1, 5, 9, 2, 77, 3, 3, 40, 8]], 4)[0]  # served (E4M3 index keys beside it)
    assert torch.isfinite(logits).all()


def test_v41_blocks_need_ue8m0_scales(tmp_path):
    hf = {**v41_config(**TINY), "quantization_config": {"quant_method": "fp8", "weight_block_size": [32, 32],
                                                        "scale_fmt": "float", "expert_dtype": "fp4"}}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match=r"\[32, 32\] with ue8m0"):
        build(EngineConfig(model=str(tmp_path), dtype="float32"), progress=False)
