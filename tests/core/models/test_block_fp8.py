"""Llama, Qwen3 and Qwen3-MoE in the fine-grained FP8 layout (E4M3 weights, fp32 128x128 block scales
in ``.weight_scale_inv``, config.json's published quantization_config), kept resident.

Each model (tiny-qwen3-py, the tiny-llama preset, a tiny Qwen3-MoE whose experts fill whole blocks)
is written in that layout by ``write_fp8_block``; the reference is the same weights dequantized by
HF transformers' FineGrainedFP8 dequantization and written as a plain fp32 checkpoint. The native
backends dequantize on every call to what the reference holds, so logits agree within
RESIDENT_BOUND (the order of fp32 sums) and greedy tokens are identical; ``quantization="none"``
dequantizes at load to the reference's parameters exactly. The bytes resident are the stored ones.
A config naming another method, block size, format or activation scheme is refused at start-up.
On a GPU (``gpu``) each model on the Triton backends is compared with the native ones.
"""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine import LLM, SamplingParams
from engine.checkpoints import write_checkpoint
from engine.checkpoints.fp8_block import PROJECTION, write_fp8_block
from engine.core.models.weights import resident_bytes
from packed_logits import ACTIVATION_BOUND, engine_logits, rel_err

Fp8Dequantize = pytest.importorskip("transformers.integrations.finegrained_fp8").Fp8Dequantize

PAGE = 16
RESIDENT_BOUND = 1e-5
TINY_QWEN3_MOE = {  # q/k/v, gate/up and every expert's rows in whole 128-row blocks
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 128, "intermediate_size": 256,
    "moe_intermediate_size": 128, "num_experts": 4, "num_experts_per_tok": 2, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 512, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 2048, "tie_word_embeddings": False, "decoder_sparse_step": 1, "mlp_only_layers": [1],
    "norm_topk_prob": True, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}


def _read(path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            out |= {k: h.get_tensor(k) for k in h.keys()}
    return out


def _reference(fp8, dst) -> None:
    """fp8's checkpoint dequantized by HF, as a plain fp32 checkpoint without quantization_config."""
    tensors = _read(fp8)
    plain = {}
    for name, t in tensors.items():
        if name.endswith(".weight_scale_inv"):
            continue
        scale = tensors.get(name.removesuffix(".weight") + ".weight_scale_inv")
        plain[name] = t.float() if scale is None else Fp8Dequantize(None)._dequantize_one(t, scale, torch.float32)
    dst.mkdir()
    for f in fp8.iterdir():
        if f.suffix == ".json" and f.name != "model.safetensors.index.json" or f.name.startswith("tokenizer"):
            shutil.copy(f, dst / f.name)
    config = json.loads((fp8 / "config.json").read_text())
    del config["quantization_config"]
    (dst / "config.json").write_text(json.dumps(config))
    save_file(plain, str(dst / "model.safetensors"))


@pytest.fixture(scope="module", params=["tiny-qwen3-py", "tiny-llama", "tiny-qwen3-moe"])
def checkpoints(request, tmp_path_factory):
    """(the FP8 layout, its dequantized reference) of one model."""
    root = tmp_path_factory.mktemp(request.param)
    if request.param == "tiny-qwen3-py":
        src = request.getfixturevalue("tiny_qwen3")
    else:
        src = write_checkpoint(root / "bf16", TINY_QWEN3_MOE if request.param == "tiny-qwen3-moe" else request.param,
                               progress=False)
    assert write_fp8_block(src, root / "fp8") > 0
    _reference(root / "fp8", root / "reference")
    return root / "fp8", root / "reference"


def _llm(path, **kw) -> LLM:
    return LLM(model=str(path), dtype="float32", device="cpu", num_pages=48, page_size=PAGE, progress=False, **kw)


def _prompts(vocab: int) -> list[list[int]]:
    return [[random.randrange(10, vocab) for _ in range(n)] for n in (1, random.randint(2, 20), random.randint(30, 60))]


def test_resident_matches_dequantized_reference(checkpoints, seed):
    """Every projection that fills whole blocks (and each expert stack) holds E4M3 and fp32 scales;
    logits within RESIDENT_BOUND of the reference's, greedy tokens identical, and the bytes resident
    are the reference's less what E4M3 saves on each kept weight."""
    fp8, ref = _llm(checkpoints[0]), _llm(checkpoints[1])
    model, ref_model = fp8.engine.components.model, ref.engine.components.model
    params = dict(model.named_parameters())
    kept = {n: p for n, p in params.items() if p.dtype == torch.float8_e4m3fn}
    assert kept and all(params[n + "_scale"].dtype == torch.float32 for n in kept)
    for name, module in model.named_modules():
        if name.endswith(("gate_up_proj", "o_proj", "down_proj", "experts")):
            assert module.scheme == "fp8_block", name
    saved = sum(p.numel() * 3 - params[n + "_scale"].numel() * 4 for n, p in kept.items())
    (held, weights), (ref_held, ref_weights) = resident_bytes(model), resident_bytes(ref_model)
    assert weights == ref_weights and ref_held - held == saved
    prompts = _prompts(model.config.vocab_size)
    c, r = fp8.engine.components, ref.engine.components
    for got, want in zip(engine_logits(c, prompts, PAGE), engine_logits(r, prompts, PAGE)):
        assert rel_err(got, want) < RESIDENT_BOUND
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)  # the CPU oracle dequantizes every step
    assert ([o.outputs[0].token_ids for o in fp8.generate(prompts[1:], greedy)]
            == [o.outputs[0].token_ids for o in ref.generate(prompts[1:], greedy)])


def test_quantization_none_dequantizes_at_load(checkpoints):
    """--quantization none: every parameter equal to the reference's, nothing kept in E4M3."""
    q, r = _llm(checkpoints[0], quantization="none"), _llm(checkpoints[1])
    q_params = dict(q.engine.components.model.named_parameters())
    r_params = dict(r.engine.components.model.named_parameters())
    assert q_params.keys() == r_params.keys()
    for name, p in q_params.items():
        assert torch.equal(p, r_params[name]), name


def test_layout_written(tiny_qwen3, tmp_path):
    """The writer's layout: E4M3 projections with fp32 scales [ceil(N/128), ceil(K/128)] under
    .weight_scale_inv, everything else as it was, the published quantization_config."""
    write_fp8_block(tiny_qwen3, tmp_path / "fp8")
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                             "weight_block_size": [128, 128]}
    src, out = _read(tiny_qwen3), _read(tmp_path / "fp8")
    for name, t in src.items():
        if PROJECTION.search(name):
            scale = out[name.removesuffix(".weight") + ".weight_scale_inv"]
            assert out[name].dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
            assert scale.shape == (-(-t.shape[0] // 128), -(-t.shape[1] // 128))
        else:
            assert torch.equal(out[name], t)
    assert len(out) == len(src) + sum(bool(PROJECTION.search(n)) for n in src)


@pytest.mark.parametrize("field, value", [("quant_method", "awq"), ("weight_block_size", [64, 64]),
                                          ("weight_block_size", None), ("fmt", "e5m2"),
                                          ("activation_scheme", "static")])
def test_refused_at_start_up_naming_the_field(tiny_qwen3, tmp_path, field, value):
    """Another method, block size (none: per-tensor FP8), format or activation scheme: refused before
    any weight is read, naming quantization_config's field."""
    for f in tiny_qwen3.iterdir():
        (tmp_path / f.name).symlink_to(f)
    (tmp_path / "config.json").unlink()
    config = json.loads((tiny_qwen3 / "config.json").read_text())
    q = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": {**q, field: value}}))
    with pytest.raises(ValueError, match=f"quantization_config.{field} is"):
        _llm(tmp_path)


@pytest.mark.gpu
def test_resident_on_the_gpu_backends(checkpoints, seed):
    """The FP8 checkpoint on the GPU in bf16: the Triton FP8 block GEMM (and for Qwen3-MoE the fused
    MoE's FP8 path), E4M3 activations, against the native backends dequantizing the same resident
    weights on the fly, which keep the activations: logits within ACTIVATION_BOUND (packed_logits.py
    says why). Prompt logprobs within 0.3, DeepSeek-V4's bound, did not fit tiny-qwen3-py's outlier
    channels: 0.77 on the H100, its logits moving as in test_triton_block_fp8_model, which passes there."""
    common = dict(device="cuda", dtype="bfloat16", max_model_len=512, kv_cache_memory="1GiB", page_size=PAGE,
                  progress=False)
    fast = LLM(str(checkpoints[0]), **common)
    oracle = LLM(str(checkpoints[0]), **common, moe_backend="native", linear_backend="native")
    chosen = {f: s.chosen.name for f, s in fast.engine.components.selections.items()}
    assert chosen["linear"] == "triton" and chosen.get("moe", "triton") == "triton"
    assert any(p.dtype == torch.float8_e4m3fn for p in fast.engine.components.model.parameters())
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, 512) for _ in range(rng.randint(2, 300))] for _ in range(4)]
    c, o = fast.engine.components, oracle.engine.components
    for got, want in zip(engine_logits(c, prompts, PAGE), engine_logits(o, prompts, PAGE)):
        assert rel_err(got.float(), want.float()) < ACTIVATION_BOUND
