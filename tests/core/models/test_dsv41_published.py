"""DeepSeek-V4.1's published quantized layout (quantization_config weight_block_size [32, 32],
scale_fmt ue8m0, expert_dtype fp4 inside it): a tiny random V4.1 with Engram written so loads with
each FP8 linear kept as stored (E4M3 and one scale per 32 x 32 block, which the FP8 linear path
multiplies), the other FP8 weights dequantized exactly as stored (Engram's tables one scale per 32
of a row, kept so and dequantized as gathered), and serves as its dequantized load does."""

from __future__ import annotations

import json
import logging
import math
import random

import pytest
import torch
from safetensors import safe_open

from engine.core.config import EngineConfig
from engine.core.engine import LLMEngine
from engine.core.models.deepseek_v4.engram import Rows
from engine.core.models.deepseek_v4.publish import write_published
from engine.core.models.layers import Linear
from engine.core.native.linear import NativeLinear
from engine.core.native.quant import FP8
from engine.core.sampling_params import SamplingParams
from engine.core.startup import build
from dsv41_random import random_v41_checkpoint, v41_config
from packed_logits import engine_logits, rel_err

# hidden 96: K of 96 is three 32-blocks where it would be one 128-block, so a scale's shape says
# which blocks it covers. The indexers keep 64 entries and the candidate filter 32 blocks of 2: over
# prompts that fit, no top-k of E4M3 index keys (ties, see DESIGN.md) decides what two loads attend.
TINY = dict(ratios=[0, 2, 2, 1, 1], kv_sources=[1, 3], index_sources=[1, 3, 4], candidate=3, blocks=32, block_size=2,
            top_k=64, engram=[0, 3], moe_intermediate_size=32)
HIDDEN = 96
PAGE = 4
# the native linear dequantizes a kept weight on every call to what the dequantized load holds, so
# only the order of fp32 sums differs
KEPT_BOUND = 1e-5


@pytest.fixture(scope="module")
def published(tmp_path_factory, run_seed, shared_dir):
    tmp = tmp_path_factory.mktemp("v41")
    hf = {**v41_config(**TINY), "hidden_size": HIDDEN}
    src = random_v41_checkpoint(tmp / "bf16", run_seed, hf, shared_dir / "models" / "tiny-dsv4-py")
    counts = write_published(src, tmp / "published", block=32)
    assert counts["fp8"] > 0 and counts["fp4"] > 0
    return tmp / "published"


def engine(path, quantization=None) -> LLMEngine:
    config = EngineConfig(model=str(path), dtype="float32", device="cpu", page_size=PAGE, num_pages=64,
                          quantization=quantization)
    return LLMEngine(config, progress=False)


@pytest.fixture(scope="module")
def kept(published):
    return engine(published)


@pytest.fixture(scope="module")
def dequantized(published):
    return engine(published, "none")


def test_the_v41_layout_keeps_its_fp8_linears_as_stored(published, kept):
    assert json.loads((published / "config.json").read_text())["quantization_config"] == {
        "quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32], "scale_fmt": "ue8m0",
        "expert_dtype": "fp4"}
    model = kept.components.model
    checked, linears = set(), 0
    with safe_open(str(next(published.glob("*.safetensors"))), framework="pt") as f:
        for name in f.keys():
            weight = name.removesuffix(".scale") + ".weight"
            if not name.endswith(".scale") or f.get_tensor(weight).dtype != FP8 or ".shared_experts." in name:
                continue  # (the shared expert lives in the experts' stack)
            data, exponent = f.get_tensor(weight), f.get_tensor(name).view(torch.uint8).float()
            module = model.get_submodule("model." + weight.removesuffix(".weight"))
            n, k = data.shape
            if isinstance(module, Linear):  # kept: its bytes, a byte a weight and an fp32 scale a 32 x 32 block
                assert module.scheme == "fp8_block" and module.weight.dtype == FP8, weight
                assert torch.equal(module.weight.view(torch.uint8), data.view(torch.uint8)), weight
                assert module.weight_scale.dtype == torch.float32, weight
                assert torch.equal(module.weight_scale, torch.exp2(exponent - 127)), weight
                assert module.weight_scale.shape == (math.ceil(n / 32), math.ceil(k / 32)), weight
                assert module.linear_weight.block == 32 or max(n, k) <= 32, weight
                linears += 1
            else:  # dequantized at load (wo_a), or a table dequantized as gathered
                rows = 1 if ".engram.embed." in name else 32
                factor = torch.exp2(exponent - 127).repeat_interleave(rows, 0)[:n].repeat_interleave(32, 1)[:, :k]
                loaded = module(torch.arange(n)) if isinstance(module, Rows) else module.weight
                assert torch.equal(loaded.float(), data.float() * factor), weight
            checked.add(weight.split(".", 2)[2])
    assert {"engram.embed.weight", "engram.wkv.weight", "attn.wq_a.weight", "attn.indexer.wq_b.weight"} <= checked
    assert linears > 0
    table = model.model.layers[3].engram.embed
    assert table.weight.dtype == FP8 and table.weight_scale.shape == (table.weight.shape[0], 1)  # 8 wide rows
    for layer in model.model.layers:  # the attention input's FP8 parts still one GEMM, on their 32-row blocks
        fp8 = [(w.block, names) for w, names, _ in layer.attn.x_proj.groups if w.scheme == "fp8_block"]
        assert fp8 and all(block == 32 for block, _ in fp8)


def greedy(e: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        e.add_request(str(i), p, params)
    outs = {}
    while e.has_unfinished_requests():
        outs.update((o.request_id, o.outputs[0].token_ids) for o in e.step() if o.finished)
    return [list(outs[str(i)]) for i in range(len(prompts))]


def prompts_of(seed: int) -> list[list[int]]:
    """Three prompts that, with 6 tokens generated, stay within the 64 entries the indexers keep."""
    rng = random.Random(seed)
    return [[rng.randrange(128) for _ in range(n)] for n in (1, rng.randint(2, 12), rng.randint(20, 40))]


def test_kept_v41_serves_as_its_dequantized_load(kept, dequantized, seed):
    """Logits within KEPT_BOUND of the load with every weight dequantized, greedy tokens equal."""
    assert dequantized.components.model.model.layers[0].attn.wq_a.weight.dtype == torch.float32
    prompts = prompts_of(seed)
    for got, want in zip(engine_logits(kept.components, prompts, PAGE),
                         engine_logits(dequantized.components, prompts, PAGE)):
        assert rel_err(got, want) < KEPT_BOUND
    assert greedy(kept, prompts, 6) == greedy(dequantized, prompts, 6)


def test_a_backend_without_32_blocks_leaves_them_dequantized(published, monkeypatch, caplog):
    """A linear backend that multiplies only 128-blocks: V4.1's FP8 linears dequantized at load, and
    the log says why."""
    monkeypatch.setattr(NativeLinear, "fp8_blocks", (128,))
    with caplog.at_level(logging.INFO):
        model = engine(published).components.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert all(m.scheme == "dense" and m.weight.dtype == torch.float32 for m in linears)
    assert "the native linear backend multiplies FP8 in square blocks of [128], not 32 x 32" in caplog.text


def test_v41_blocks_need_ue8m0_scales(tmp_path):
    hf = {**v41_config(**TINY), "quantization_config": {"quant_method": "fp8", "weight_block_size": [32, 32],
                                                        "scale_fmt": "float", "expert_dtype": "fp4"}}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match=r"\[32, 32\] with ue8m0"):
        build(EngineConfig(model=str(tmp_path), dtype="float32"), progress=False)
