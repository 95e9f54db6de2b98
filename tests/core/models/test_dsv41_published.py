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
from engine.core.models.deepseek_v4.publish import write_published
from engine.core.models.deepseek_v4.attention import GroupedLinear
from engine.core.models.layers import Linear
from engine.core.models.weights import resident_bytes
from engine.core.native.linear import NativeLinear
from engine.core.native.moe import NativeMoE
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


# where a published shared-expert projection lives in its stack: (stack tensor, half of gate_up or None)
SHARED = {"w1": ("gate_up", 0), "w3": ("gate_up", 1), "w2": ("down", None)}


def kept_as_stored(model, name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(E4M3 data, fp32 scales) that ``model`` holds for the checkpoint's FP8 weight ``name``, or None
    where it holds it otherwise: a Linear's, wo_a's, or the shared expert's slice of its stack."""
    path, _, projection = name.removesuffix(".weight").rpartition(".")
    if ".shared_experts" in path:
        stack, half = SHARED[projection]
        stack_owner = model.get_submodule("model." + path)
        data, scale = getattr(stack_owner, stack)[0], getattr(stack_owner, stack + "_scale")
        if stack_owner.scheme != "fp8_block":
            return None
        if half is not None:
            rows = data.shape[0] // 2
            data, scale = data[half * rows:(half + 1) * rows], scale[0][half * rows // 32:(half + 1) * rows // 32]
        else:
            scale = scale[0]
        return data, scale
    module = model.get_submodule("model." + name.removesuffix(".weight"))
    if isinstance(module, (Linear, GroupedLinear)) and module.scheme == "fp8_block":
        return module.weight, module.weight_scale
    return None


def test_the_v41_layout_keeps_its_fp8_linears_as_stored(published, kept):
    """Every FP8 linear, wo_a and the shared expert's three projections hold the stored bytes and an
    fp32 scale a 32 x 32 block, equal to the stored E8M0's; the Engram tables are dequantized as
    gathered."""
    assert json.loads((published / "config.json").read_text())["quantization_config"] == {
        "quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32], "scale_fmt": "ue8m0",
        "expert_dtype": "fp4"}
    model = kept.components.model
    checked, stored = set(), 0
    with safe_open(str(next(published.glob("*.safetensors"))), framework="pt") as f:
        for name in f.keys():
            weight = name.removesuffix(".scale") + ".weight"
            if not name.endswith(".scale") or f.get_tensor(weight).dtype != FP8:
                continue
            data, exponent = f.get_tensor(weight), f.get_tensor(name).view(torch.uint8).float()
            n, k = data.shape
            held = kept_as_stored(model, weight)
            if held is not None:  # kept: its bytes, a byte a weight and an fp32 scale a 32 x 32 block
                assert held[0].dtype == FP8 and torch.equal(held[0].view(torch.uint8), data.view(torch.uint8)), weight
                assert held[1].dtype == torch.float32, weight
                assert torch.equal(held[1], torch.exp2(exponent - 127)), weight
                assert held[1].shape == (math.ceil(n / 32), math.ceil(k / 32)), weight
                stored += 1
            else:  # a table dequantized as gathered
                assert ".engram.embed." in name, weight
                module = model.get_submodule("model." + weight.removesuffix(".weight"))
                factor = torch.exp2(exponent - 127)[:n].repeat_interleave(32, 1)[:, :k]
                assert torch.equal(module(torch.arange(n)).float(), data.float() * factor), weight
            checked.add(weight.split(".", 2)[2])
    assert {"engram.embed.weight", "engram.wkv.weight", "attn.wq_a.weight", "attn.indexer.wq_b.weight",
            "attn.wo_a.weight", "ffn.shared_experts.w1.weight", "ffn.shared_experts.w2.weight",
            "ffn.shared_experts.w3.weight"} <= checked
    assert stored > 0
    for layer in model.model.layers:
        assert layer.attn.wo_a.scheme == "fp8_block"
        assert layer.ffn.shared_experts.block == 32 and layer.ffn.experts.scheme == "fp4"
    table = model.model.layers[3].engram.embed
    assert table.weight.dtype == FP8 and table.weight_scale.shape == (table.weight.shape[0], 1)  # 8 wide rows
    for layer in model.model.layers:  # the attention input's FP8 parts still one GEMM, on their 32-row blocks
        fp8 = [(w.block, names) for w, names, _ in layer.attn.x_proj.groups if w.scheme == "fp8_block"]
        assert fp8 and all(block == 32 for block, _ in fp8)


def test_resident_bytes_per_parameter(kept, dequantized):
    """wo_a and the shared expert hold a byte a weight and 4 bytes a 32 x 32 block where the
    dequantized load holds 4 a weight (fp32), and the model's bytes per parameter (what start-up
    logs) fall with them."""
    for layer, dense in zip(kept.components.model.model.layers, dequantized.components.model.model.layers):
        assert resident_bytes(dense.attn.wo_a) == (4 * dense.attn.wo_a.weight.numel(), dense.attn.wo_a.weight.numel())
        for owner in (layer.attn.wo_a, layer.ffn.shared_experts):
            held, weights = resident_bytes(owner)
            blocks = sum(p.numel() for n, p in owner.named_parameters() if n.endswith("_scale"))
            assert blocks > 0 and held == weights + 4 * blocks
    per_param = [held / weights for held, weights in (resident_bytes(e.components.model) for e in (kept, dequantized))]
    assert per_param[0] < per_param[1] == pytest.approx(4.0, abs=0.05)


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
    """A linear backend and a MoE backend that multiply only 128-blocks: V4.1's FP8 linears and its
    shared expert dequantized at load, and the log says why."""
    monkeypatch.setattr(NativeLinear, "fp8_blocks", (128,))
    monkeypatch.setattr(NativeMoE, "fp8_blocks", (128,))
    with caplog.at_level(logging.INFO):
        model = engine(published).components.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert all(m.scheme == "dense" and m.weight.dtype == torch.float32 for m in linears)
    assert all(layer.ffn.shared_experts.scheme == "dense" for layer in model.model.layers)
    assert "the native linear backend multiplies FP8 in square blocks of [128], not 32 x 32" in caplog.text
    assert "the native MoE backend multiplies FP8 experts in square blocks of [128], not 32 x 32" in caplog.text


def test_v41_blocks_need_ue8m0_scales(tmp_path):
    hf = {**v41_config(**TINY), "quantization_config": {"quant_method": "fp8", "weight_block_size": [32, 32],
                                                        "scale_fmt": "float", "expert_dtype": "fp4"}}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match=r"\[32, 32\] with ue8m0"):
        build(EngineConfig(model=str(tmp_path), dtype="float32"), progress=False)
