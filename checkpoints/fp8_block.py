"""Writing a Llama / Qwen3 / Qwen3-MoE checkpoint in the fine-grained FP8 layout that Qwen's
``*-FP8`` checkpoints are published in (core/models/block_fp8.py reads it).

Every projection of the decoder layers (attention q/k/v/o, the MLP's and each expert's
gate/up/down) becomes E4M3 with one fp32 scale per 128 x 128 block (amax / 448) under
``<name>.weight_scale_inv``; embeddings, norms, the MoE router and the LM head stay as they were.
So a random-weight checkpoint (``write_checkpoint``) can be served and measured as those are.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..core.native.quant import quantize_fp8_block

BLOCK = 128
PROJECTION = re.compile(r"\.(q|k|v|o|gate|up|down)_proj\.weight$")
QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                       "weight_block_size": [BLOCK, BLOCK]}


def _shards(src: Path) -> list[str]:
    index = src / "model.safetensors.index.json"
    if index.exists():
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    return [p.name for p in sorted(src.glob("*.safetensors"))]


def write_fp8_block(src: str | Path, dst: str | Path, device: str | torch.device = "cpu") -> int:
    """Writes the checkpoint in ``src`` (HF names, any float dtype) to ``dst`` in the fine-grained
    FP8 layout, a shard for each of src's, quantizing on ``device``; returns how many weights it
    quantized (none is an error: ``src`` is then no Llama-family checkpoint)."""
    src, dst, device = Path(src), Path(dst), torch.device(device)
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(f, dst / f.name)
    config = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "quantization_config": dict(QUANTIZATION_CONFIG)},
                                                indent=2))
    quantized, size, weight_map = 0, 0, {}
    for shard in _shards(src):
        tensors = {}
        with safe_open(str(src / shard), framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                if PROJECTION.search(name):
                    data, scale = quantize_fp8_block(t.to(device), BLOCK)
                    tensors[name] = data.cpu()
                    tensors[name.removesuffix(".weight") + ".weight_scale_inv"] = scale.cpu()
                    quantized += 1
                else:
                    tensors[name] = t
        save_file({n: t.contiguous() for n, t in tensors.items()}, str(dst / shard))
        weight_map |= dict.fromkeys(tensors, shard)
        size += sum(t.numel() * t.element_size() for t in tensors.values())
    if not quantized:
        raise ValueError(f"{src} has no projection weights ('...self_attn.q_proj.weight', '...mlp.down_proj.weight') "
                         f"to quantize")
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": size},
                                                                  "weight_map": weight_map}))
    return quantized
