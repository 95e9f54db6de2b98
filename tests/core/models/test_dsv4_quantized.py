"""DeepSeek-V4 in the published quantized layout: FP8 E4M3 with E8M0 128x128 block scales for the
attention and shared-expert linears, FP4 E2M1 with one E8M0 per 32 for the routed experts.

tiny-dsv4-py is quantized into that layout (published names, scales under ``.scale`` or HF's
``.weight_scale_inv``, uint8 or float8_e8m0fnu, packed FP4 as int8, uint8 or float4_e2m1fn_x2, two
shards in shuffled order: all drawn fresh each run). The reference dequantizes it with HF
transformers' own FP8/FP4 dequantization and is written as a plain fp32 checkpoint. By default the
engine keeps the weights as stored (FP8 linears with fp32 block scales, FP4 routed experts with
E8M0 scales, the native backends dequantizing on the fly) and the indexer's keys in E4M3: its
logits must match the engine's on the reference, served as FP8 weights are (its config naming the
published quantization, so its indexer keys are E4M3 too), within RESIDENT_BOUND, and HF's on it
where the indexer keeps every entry; with ``quantization="none"`` its parameters must equal the
reference's and its keys stay fp32. The bytes per parameter resident are checked against the checkpoint's
own, and the quantizers against brute force.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.core.config import EngineConfig
from engine.core.kv.storage import KVCache
from engine.core.models.deepseek_v4.cache import component_bytes_per_token
from engine.core.models.deepseek_v4.publish import FP8_LINEARS, ROUTED, publish, published_config, weight_format
from engine.core.models.weights import resident_bytes
from engine.core.native.quant import (E2M1_VALUES, dequantize_fp4, dequantize_fp8_block_e8m0, quantize_fp4,
                                     quantize_fp8_block_e8m0, unpack_fp4)
from engine.core.startup import build
from packed_logits import ACTIVATION_BOUND, engine_logits, hf_logits, rel_err

Fp8Dequantize = pytest.importorskip("transformers.integrations.finegrained_fp8").Fp8Dequantize

PAGE = 16


def test_fp4_rounds_to_nearest_e2m1_ties_to_even(seed):
    """Blocks pinned to amax 6 * 2**e (so the scale is 2**e) holding random values and every midpoint
    of the E2M1 grid; brute force picks the nearest value, the even code among two."""
    grid = torch.tensor(E2M1_VALUES)
    rows, blocks = 16, 4
    e = torch.randint(-20, 20, (rows, blocks, 1)).float()
    v = torch.empty(rows, blocks, 32).uniform_(-6, 6)
    mids = (grid[1:] + grid[:-1]) / 2
    v[..., 1:1 + len(mids)] = mids * torch.where(torch.rand(rows, blocks, len(mids)) < 0.5, -1.0, 1.0)
    v[..., 0] = 6.0 * torch.where(torch.rand(rows, blocks) < 0.5, -1.0, 1.0)
    v = v[..., torch.randperm(32)]
    x = (v * torch.exp2(e)).flatten(-2)
    packed, scale = quantize_fp4(x)
    assert torch.equal(scale.long(), (e[..., 0] + 127).long())
    dist = (v.abs()[..., None] - grid).abs()
    odd = torch.arange(len(grid)) % 2
    code = torch.where(dist == dist.min(-1, keepdim=True).values, odd, 2).argmin(-1)  # nearest, then even
    want = (grid[code] * v.sign() * torch.exp2(e)).flatten(-2)
    assert torch.equal(dequantize_fp4(packed, scale), want)
    hf_unpack = Fp8Dequantize(None)._unpack_fp4(packed.view(torch.int8))  # low nibble first, as HF reads it
    assert torch.equal(unpack_fp4(packed), hf_unpack)


def test_fp8_e8m0_block_scales(seed):
    """Partial edge blocks, power-of-two scales with amax / scale in (224, 448], E4M3 precision."""
    n, k = random.randint(129, 300), random.randint(129, 300)
    w = torch.randn(n, k) * torch.exp2(torch.randint(-8, 8, (1,)).float())
    data, scale = quantize_fp8_block_e8m0(w)
    assert scale.shape == (-(-n // 128), -(-k // 128)) and scale.dtype == torch.uint8
    s = torch.exp2(scale.float() - 127)
    amax = torch.stack([torch.stack([w[i:i + 128, j:j + 128].abs().max() for j in range(0, k, 128)])
                        for i in range(0, n, 128)])
    assert bool(((amax / s > 224) & (amax / s <= 448)).all())
    got = dequantize_fp8_block_e8m0(data, scale)
    expanded = s.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    assert torch.equal(got, data.float() * expanded)
    assert bool(((got - w).abs() <= w.abs() / 16 + expanded * 2.0 ** -10).all())


@pytest.fixture(scope="module")
def tiny(shared_dir):
    return shared_dir / "models" / "tiny-dsv4-py"


def read(path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def hf_dequantize(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """HF's dequantization; it reads packed FP4 from int8 or float4_e2m1fn_x2 (not uint8)."""
    if weight.dtype == torch.uint8:
        weight = weight.view(torch.int8)
    return Fp8Dequantize(None)._dequantize_one(weight, scale, output_dtype=torch.float32)


def write(path, tiny, tensors: dict[str, torch.Tensor], order_seed: int, config: dict | None = None,
          shards: int = 1) -> None:
    path.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tiny / f, path / f)
    if config is not None:
        (path / "config.json").write_text(json.dumps(config))
    names = list(tensors)
    random.Random(order_seed + shards).shuffle(names)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = names[i::shards]
        save_file({n: tensors[n].contiguous() for n in part}, str(path / file))
        weight_map |= {n: file for n in part}
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": size},
                                                                   "weight_map": weight_map}))


@pytest.fixture(scope="module")
def checkpoints(tiny, tmp_path_factory, run_seed):
    """(quantized layout, its dequantized reference, the quantized tensors): fresh choices each run."""
    rng = random.Random(run_seed)
    scale_suffix = rng.choice(["scale", "weight_scale_inv"])
    scale_dtype = rng.choice([torch.uint8, torch.float8_e8m0fnu])
    packed_dtype = rng.choice([torch.int8, torch.uint8, torch.float4_e2m1fn_x2])
    quantized, reference, kinds = {}, {}, {"fp8": 0, "fp4": 0}
    for name, t in read(tiny).items():
        out, data, scale = publish(name, t)
        if scale is None:
            quantized[out] = reference[name] = t
            continue
        kind = weight_format(name)
        if kind == "fp4":
            data = data.view(packed_dtype)
        scale = scale.view(scale_dtype)
        quantized[out] = data
        quantized[out.removesuffix(".weight") + "." + scale_suffix] = scale
        reference[name] = hf_dequantize(data, scale)
        kinds[kind] += 1
    assert kinds["fp8"] > 0 and kinds["fp4"] > 0
    config = published_config(json.loads((tiny / "config.json").read_text()))
    root = tmp_path_factory.mktemp("dsv4q")
    write(root / "quantized", tiny, quantized, run_seed, config, shards=2)
    write(root / "reference", tiny, reference, run_seed)
    write(root / "reference-fp8-index-keys", tiny, reference, run_seed, config)
    print(f"layout: scales in .{scale_suffix} as {scale_dtype}, FP4 packed as {packed_dtype}")
    return root / "quantized", root / "reference", quantized, root / "reference-fp8-index-keys"


def engine(path, quantization=None):
    return build(EngineConfig(model=str(path), dtype="float32", page_size=PAGE, num_pages=120,
                              quantization=quantization), progress=False)


def index_key_dtypes(c) -> set[torch.dtype]:
    """The element types of an engine's indexer keys and (where E4M3) of their scales."""
    layers = [layer.attn.cache.index_keys for layer in c.model.model.layers if layer.attn.cache.index_keys is not None]
    assert layers
    return {t.dtype for i in layers for t in (c.kv.layer(i).k, c.kv.layer(i).v) if t.numel()}


def check_logits(q, r, bound):
    prompts = [[random.randrange(q.model_config.vocab_size) for _ in range(n)]
               for n in (1, random.randint(2, 40), random.randint(60, 150))]
    for p, got, want in zip(prompts, engine_logits(q, prompts, PAGE), engine_logits(r, prompts, PAGE)):
        err = rel_err(got, want)
        assert err < bound, f"length {len(p)}: relative error {err:.2e}"


@pytest.fixture(scope="module")
def reference_engine(checkpoints):
    return engine(checkpoints[1])


def test_dequantized_at_load_equals_reference(checkpoints, reference_engine, seed):
    """--quantization none: every weight dequantized to the model's dtype at load."""
    q, r = engine(checkpoints[0], "none"), reference_engine
    q_params, r_params = dict(q.model.named_parameters()), dict(r.model.named_parameters())
    assert q_params.keys() == r_params.keys()
    for name, p in q_params.items():
        assert torch.equal(p, r_params[name]), f"{name} differs from the dequantized reference"
    assert all(len(layer.attn.x_proj.groups) == 1 for layer in q.model.model.layers)  # one GEMM of the input
    assert index_key_dtypes(q) == index_key_dtypes(r) == {torch.float32}
    check_logits(q, r, 1e-6)


# The native backends dequantize the stored formats on every call to what the reference holds, so
# only the order of fp32 sums differs
RESIDENT_BOUND = 1e-5


@pytest.fixture(scope="module")
def fp8_keys_reference_engine(checkpoints):
    return engine(checkpoints[3])


def test_resident_formats_match_dequantized_reference(checkpoints, quantized_engine, fp8_keys_reference_engine,
                                                      seed):
    """FP8 linears and shared experts keep E4M3 with the E8M0 scales as fp32, routed experts packed FP4
    with E8M0 scales; the grouped output projection (wo_a, not a Linear) is dequantized at load. The
    projections of the attention input run as one GEMM per format: the compressors' and the
    indexer's (bf16 as published) as one. The indexer's keys are E4M3 with fp32 scales, in both."""
    assert index_key_dtypes(quantized_engine) == index_key_dtypes(fp8_keys_reference_engine) == {
        torch.float8_e4m3fn, torch.float32}
    params = dict(quantized_engine.model.named_parameters())
    fp8 = [n for n in checkpoints[2] if FP8_LINEARS.search(n) and ".shared_experts." not in n]
    for name in fp8:
        param = "model." + name.removesuffix(".weight")
        if name.endswith(".wo_a.weight"):
            assert params[param + ".weight"].dtype == torch.float32 and param + ".weight_scale" not in params
            continue
        assert params[param + ".weight"].dtype == torch.float8_e4m3fn
        assert params[param + ".weight_scale"].dtype == torch.float32
    for layer in quantized_engine.model.model.layers:  # the attention input's projections, a GEMM per format
        groups = [(weight.scheme, names) for weight, names, _ in layer.attn.x_proj.groups]
        assert {n for scheme, names in groups if scheme == "fp8_block" for n in names} == {"wq_a", "wkv"}
        assert sum(scheme == "dense" for scheme, _ in groups) == (len(layer.attn.x_proj.parts) > 2)
        q_groups = [(weight.scheme, names) for weight, names, _ in layer.attn.q_proj.groups]  # both FP8
        assert q_groups == [("fp8_block", list(layer.attn.q_proj.parts))]
    for layer in range(quantized_engine.model_config.hf["num_hidden_layers"]):
        stack = f"model.layers.{layer}.ffn.experts"
        assert params[stack + ".gate_up"].dtype == params[stack + ".gate_up_scale"].dtype == torch.uint8
        assert params[stack + ".down"].shape[-1] * 2 == params[f"model.layers.{layer}.ffn.shared_experts.down"].shape[-1]
    check_logits(quantized_engine, fp8_keys_reference_engine, RESIDENT_BOUND)


def test_index_keys_cost_their_e4m3_bytes(quantized_engine, reference_engine):
    """Beside FP8 weights a token costs its CSA layers' indexer keys at a byte a channel and 4 bytes a
    key for the scale (per rate tokens), where the dequantized model spends 4 a channel (fp32); every
    other component is unchanged, and the KV pages add up to it."""
    def per_token(c):
        return component_bytes_per_token(c.kv.specs, [layer.attn.cache for layer in c.model.model.layers], c.kv.dtype)

    hf = quantized_engine.model_config.hf
    csa, rate, d = (hf["layer_types"].count("compressed_sparse_attention"),
                    hf["compress_rates"]["compressed_sparse_attention"], hf["index_head_dim"])
    fp8, dense = per_token(quantized_engine), per_token(reference_engine)
    kv = quantized_engine.kv
    paged = sum(v for k, v in fp8.items() if k not in ("window", "projections", "index_projections"))
    assert paged * kv.page_size == KVCache.bytes_per_page(kv.specs, kv.page_size, kv.dtype)
    assert fp8.pop("index_keys") == csa * (d + 4) / rate and dense.pop("index_keys") == csa * d * 4 / rate
    assert fp8 == dense


def test_bytes_per_parameter_resident(checkpoints, quantized_engine, reference_engine):
    """Each quantized weight costs its stored bytes (E4M3: 1 a weight and an fp32 scale per 128x128;
    FP4: half a byte and an E8M0 byte per 32) where the dequantized model spends 4 (fp32)."""
    held, weights = resident_bytes(quantized_engine.model)
    dense_held, dense_weights = resident_bytes(reference_engine.model)
    assert weights == dense_weights
    saved, tensors = 0, checkpoints[2]
    params = dict(quantized_engine.model.named_parameters())
    for name, t in tensors.items():
        if not (name.endswith(".weight") and (FP8_LINEARS.search(name) or ROUTED.search(name))):
            continue
        if params[quantized_engine.model.resolve(name).param].dtype in (torch.float8_e4m3fn, torch.uint8):
            scale = tensors[_scale_of(tensors, name)]
            stored = t.numel() + scale.numel() * (4 if t.dtype == torch.float8_e4m3fn else 1)
            saved += t.numel() * (2 if ROUTED.search(name) else 1) * 4 - stored
    assert dense_held - held == saved
    print(f"resident: {held} bytes for {weights} parameters, {held / weights:.3f} bytes per parameter "
          f"(dequantized fp32: {dense_held / dense_weights:.3f})")


def test_quantized_checkpoint_matches_hf_on_dequantized_weights(checkpoints, quantized_engine, seed):
    """HF deepseek_v4 on the dequantized reference. Prompts stay within index_topk * CSA rate tokens,
    where the indexer keeps every entry, so its top-k ties (see DESIGN.md) cannot matter."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoints[1], dtype=torch.float32)
    cfg = quantized_engine.model_config.hf
    longest = cfg["index_topk"] * cfg["compress_rates"]["compressed_sparse_attention"]
    prompts = [[random.randrange(cfg["vocab_size"]) for _ in range(random.randint(1, longest))] for _ in range(3)]
    for p, got in zip(prompts, engine_logits(quantized_engine, prompts, PAGE)):
        err = rel_err(got, hf_logits(hf, p))
        assert err < 1e-4, f"length {len(p)}: relative error {err:.2e}"


def test_quantization_option(tiny):
    import argparse

    from engine.server.engine_args import add_engine_args, engine_config

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config(parser.parse_args(["--model", str(tiny), "--quantization", "none"])).quantization == "none"
    assert engine_config(parser.parse_args(["--model", str(tiny)])).quantization is None
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(model=str(tiny), quantization="fp8")


@pytest.fixture(scope="module")
def quantized_engine(checkpoints):
    return engine(checkpoints[0])


@pytest.fixture
def fresh(checkpoints, quantized_engine):
    """A new unloaded model (the quantized engine's class and config) and the quantized tensors to break."""
    c, tensors = quantized_engine, checkpoints[2]
    return lambda hf=None: type(c.model)(dataclasses.replace(c.model_config, hf=hf or c.model_config.hf),
                                         c.model.backends), dict(tensors)


def _scale_of(tensors: dict, weight: str) -> str:
    prefix = weight.removesuffix(".weight")
    return next(n for n in tensors if n.startswith(prefix + ".") and n != weight)


def _pick(tensors: dict, pattern: str) -> str:
    return random.choice([n for n in tensors if re.search(pattern, n) and n.endswith(".weight")])


def test_unknown_weight_dtype(fresh, seed):
    new, tensors = fresh
    name = _pick(tensors, FP8_LINEARS.pattern)
    tensors[name] = tensors[name].float().to(torch.float8_e5m2)
    with pytest.raises(ValueError, match=re.escape(repr(name)) + ".*float8_e5m2"):
        new().load_weights(tensors.items())


@pytest.mark.parametrize("pattern", [FP8_LINEARS.pattern, ROUTED.pattern])
def test_scale_of_wrong_shape(fresh, seed, pattern):
    new, tensors = fresh
    name = _pick(tensors, pattern)
    scale = _scale_of(tensors, name)
    s = tensors[scale]
    tensors[scale] = torch.cat([s, s], dim=random.randrange(2))
    with pytest.raises(ValueError, match=f"{re.escape(repr(scale))} has shape .*{re.escape(repr(name))}"):
        new().load_weights(tensors.items())


@pytest.mark.parametrize("pattern", [FP8_LINEARS.pattern, ROUTED.pattern])
def test_quantized_weight_without_scale(fresh, seed, pattern):
    new, tensors = fresh
    name = _pick(tensors, pattern)
    del tensors[_scale_of(tensors, name)]
    with pytest.raises(ValueError, match="without a scale.*" + re.escape(repr(name))):
        new().load_weights(tensors.items())


def test_scale_without_quantized_weight(fresh, seed):
    new, tensors = fresh
    name = _pick(tensors, r"\.attn\.compressor\.wkv\.weight$")  # kept in bf16, as the published layout does
    tensors[name.removesuffix(".weight") + ".scale"] = torch.zeros(1, 2, dtype=torch.uint8)
    with pytest.raises(ValueError, match=re.escape(repr(name.removesuffix(".weight") + ".scale"))):
        new().load_weights(tensors.items())


def test_scale_of_wrong_dtype(fresh, seed):
    new, tensors = fresh
    name = _pick(tensors, ROUTED.pattern)
    scale = _scale_of(tensors, name)
    tensors[scale] = tensors[scale].view(torch.uint8).float()  # fp32 scales are FP8-only (DeepSeek-V3's)
    with pytest.raises(ValueError, match=re.escape(repr(scale)) + ".*dtype torch.float32"):
        new().load_weights(tensors.items())


@pytest.mark.parametrize("change", [{"weight_block_size": [64, 64]}, {"fmt": "e5m2"}, {"quant_method": "awq"}])
def test_unknown_quantization_config(fresh, change):
    new, _ = fresh
    hf = new().config.hf
    bad = {**hf, "quantization_config": {**hf["quantization_config"], **change}}
    with pytest.raises(ValueError, match="not the published layout"):
        new(bad)


def test_fp32_block_scales_and_quantized_mtp(fresh, quantized_engine, seed):
    """DeepSeek-V3's fp32 block scales load like the E8M0 ones; a quantized next-n weight is kept dequantized."""
    new, tensors = fresh
    for name in [n for n in tensors if FP8_LINEARS.search(n)]:
        scale = _scale_of(tensors, name)
        tensors[scale] = torch.exp2(tensors[scale].view(torch.uint8).float() - 127)
    w = torch.randn(random.randint(1, 300), random.randint(1, 300))
    data, scale = quantize_fp8_block_e8m0(w)
    tensors |= {"mtp.0.attn.wq_a.weight": data, "mtp.0.attn.wq_a.scale": scale}
    model = new()
    model.load_weights(tensors.items())
    want = dict(quantized_engine.model.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p, want[name]), name
    assert model.mtp.keys() == {"mtp.0.attn.wq_a.weight"}
    assert torch.equal(model.mtp["mtp.0.attn.wq_a.weight"], dequantize_fp8_block_e8m0(data, scale))


@pytest.mark.gpu
def test_resident_formats_on_the_gpu_backends(checkpoints, seed):
    """The quantized checkpoint on the GPU in bf16: the Triton FP8 block GEMM and FP4 MoE GEMM (E4M3
    activations for the FP8 linears; the MoE's stay bf16) against the native backends dequantizing
    the same resident weights on the fly, which keep the activations: logits within ACTIVATION_BOUND
    (packed_logits.py says why). Prompt logprobs within 0.3, a bound set before any GPU run, missed
    by 0.011 on the H100: a logprob carries the error of two logits."""
    from engine import LLM

    common = dict(device="cuda", dtype="bfloat16", max_model_len=1024, page_size=PAGE, progress=False)
    fast = LLM(str(checkpoints[0]), **common)
    oracle = LLM(str(checkpoints[0]), **common, moe_backend="native", linear_backend="native")
    params = dict(fast.engine.components.model.named_parameters())
    assert params["model.layers.2.ffn.experts.gate_up"].dtype == torch.uint8
    assert params["model.layers.2.attn.wq_a.weight"].dtype == torch.float8_e4m3fn
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, 4096) for _ in range(rng.randint(2, 300))] for _ in range(4)]
    c, o = fast.engine.components, oracle.engine.components
    for got, want in zip(engine_logits(c, prompts, PAGE), engine_logits(o, prompts, PAGE)):
        assert rel_err(got.float(), want.float()) < ACTIVATION_BOUND
