"""Writing DeepSeek-V4 weights in the published quantized layout, the one checkpoint.py reads.

The attention linears and the shared expert become FP8 E4M3 with one E8M0 scale per 128x128 block
(V4.1's layout, ``block=32``: 32x32 blocks, Engram's ``wkv`` too, and its tables one scale per 32 of
a row), the routed experts packed FP4 E2M1 with one E8M0 scale per 32 along K, under the published names
(no ``model.`` prefix, ``embed``, ``norm``, ``hc_head_*``); the rest (norms, embeddings, the router,
the compressors and indexer projections DeepSeek keeps in bf16) passes through. This lets a bf16
checkpoint (HF's ``save_pretrained``, a random-weight one) be served and measured as DeepSeek ships it.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ...native.quant import quantize_fp4, quantize_fp8_block_e8m0
from .checkpoint import BLOCK, V41_BLOCK

ROUTED = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$")
FP8_LINEARS = re.compile(r"\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123]|engram\.wkv)"
                         r"\.weight$")
ENGRAM_TABLE = re.compile(r"\.engram\.embed\.weight$")
RENAMED = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
           "model.hc_head.hc_fn": "hc_head_fn", "model.hc_head.hc_base": "hc_head_base",
           "model.hc_head.hc_scale": "hc_head_scale"}
QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "activation_scheme": "dynamic",
                       "weight_block_size": [BLOCK, BLOCK]}


def published_name(name: str) -> str:
    return RENAMED.get(name, name.removeprefix("model."))


def unstacked_experts(weights: dict[str, torch.Tensor], routed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """A model's state dict under a checkpoint's expert names: each stacked ``experts.gate_up`` /
    ``experts.down`` split into routed ``experts.<e>.w1/w3/w2`` and, past ``routed``, the folded shared
    expert as ``shared_experts``; what a random-weight checkpoint is written from."""
    for name, t in weights.items():
        stack, _, part = name.rpartition(".experts.")
        if not stack or part not in ("gate_up", "down"):
            yield name, t
            continue
        for e in range(t.shape[0]):
            prefix = f"{stack}.experts.{e}" if e < routed else f"{stack}.shared_experts"
            if part == "down":
                yield f"{prefix}.w2.weight", t[e].contiguous()
            else:
                gate, up = t[e].chunk(2)
                yield f"{prefix}.w1.weight", gate.contiguous()
                yield f"{prefix}.w3.weight", up.contiguous()


def shaped_model(path: str | Path):
    """The model the config.json in ``path`` describes, its parameters unfilled, on the platform's
    backends in fp32: what names and shapes the weights of a checkpoint written for it (V4.1 has no
    HF model to do that)."""
    from ...config import EngineConfig, ModelConfig
    from ...plugins import load_plugins
    from ...registry import SelectionContext
    from ...startup import model_families, select_backends
    from ..base import Backends
    from .model import DeepseekV4ForCausalLM

    config = ModelConfig.from_dir(path, "float32")
    plugins = load_plugins()
    ctx = SelectionContext(platform=plugins.detect_platform(), model_config=config,
                           engine_config=EngineConfig(model=str(path), dtype="float32"))
    selections = select_backends(plugins, ctx, ctx.engine_config, model_families(DeepseekV4ForCausalLM))
    return DeepseekV4ForCausalLM(config, Backends(**{f: s.create(ctx) for f, s in selections.items()}))


def weight_format(name: str, block: int = BLOCK) -> str | None:
    """'fp4' for a routed expert's weight, 'fp8' for an attention, shared-expert or Engram linear,
    'fp8 rows' for an Engram table in V4.1's layout, else None."""
    if ROUTED.search(name):
        return "fp4"
    if ENGRAM_TABLE.search(name) and block == V41_BLOCK:
        return "fp8 rows"
    return "fp8" if FP8_LINEARS.search(name) else None


def publish(name: str, tensor: torch.Tensor, block: int = BLOCK) -> tuple[str, torch.Tensor, torch.Tensor | None]:
    """(published name, the tensor as stored, its E8M0 scale as uint8 or None where it passes through);
    the scale goes under ``<name without .weight>.scale``."""
    kind = weight_format(name, block)
    if kind is None:
        return published_name(name), tensor, None
    if kind == "fp4":
        data, scale = quantize_fp4(tensor)
    else:
        data, scale = quantize_fp8_block_e8m0(tensor, 1 if kind == "fp8 rows" else block, block)
    return published_name(name), data, scale


def published_config(hf: dict, block: int = BLOCK) -> dict:
    """config.json of the quantized layout: the published quantization_config, FP4 routed experts
    (V4.1's, ``block=32``, names the experts' format inside it)."""
    if block == V41_BLOCK:
        return {**hf, "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
                                              "weight_block_size": [block, block], "scale_fmt": "ue8m0",
                                              "expert_dtype": "fp4"}}
    return {**hf, "quantization_config": dict(QUANTIZATION_CONFIG), "expert_dtype": "fp4"}


def _shards(src: Path) -> list[str]:
    index = src / "model.safetensors.index.json"
    if index.exists():
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    return ["model.safetensors"]


def _published_shard(path: Path, device: torch.device, block: int) -> Iterator[tuple[str, torch.Tensor]]:
    with safe_open(str(path), framework="pt") as f:
        for name in f.keys():
            out, data, scale = publish(name, f.get_tensor(name).to(device), block)
            yield out, data.cpu()
            if scale is not None:
                yield out.removesuffix(".weight") + ".scale", scale.cpu()


def write_published(src: str | Path, dst: str | Path, device: str | torch.device = "cpu",
                    block: int = BLOCK) -> dict[str, int]:
    """Writes the checkpoint in ``src`` (HF names, any float dtype) to ``dst`` in the published layout
    (FP8 in blocks of ``block``: 128, V4's, or 32, V4.1's), a shard for each of src's, quantizing on
    ``device``; returns the count of fp8 and fp4 weights and the bytes written. A checkpoint with no
    weight to quantize under V4's names is an error."""
    src, dst, device = Path(src), Path(dst), torch.device(device)
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(f, dst / f.name)
    (dst / "config.json").write_text(json.dumps(published_config(json.loads((src / "config.json").read_text()),
                                                                 block), indent=2))
    counts, weight_map = {"fp8": 0, "fp4": 0, "bytes": 0}, {}
    for shard in _shards(src):
        tensors = dict(_published_shard(src / shard, device, block))
        save_file({n: t.contiguous() for n, t in tensors.items()}, str(dst / shard))
        weight_map |= dict.fromkeys(tensors, shard)
        for name, t in tensors.items():
            counts["bytes"] += t.numel() * t.element_size()
            if name.endswith(".scale"):
                counts[weight_format(name.removesuffix(".scale") + ".weight", block).split()[0]] += 1
    if not counts["fp8"] or not counts["fp4"]:
        raise ValueError(f"{src} has {counts['fp8']} attention/shared-expert linears and {counts['fp4']} routed "
                         f"expert weights under DeepSeek-V4's names ('...attn.wq_a.weight', "
                         f"'...ffn.experts.<e>.w1.weight'); the published layout needs both")
    (dst / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": counts["bytes"]}, "weight_map": weight_map}))
    return counts
