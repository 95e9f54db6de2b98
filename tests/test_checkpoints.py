"""The random-checkpoint generator against HF transformers: names, shapes, configs, tokenizer, bytes."""

from __future__ import annotations

import json
import logging
import random
import threading
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from engine.checkpoints import (
    PRESETS, SPECIAL_TOKENS, TOKENIZER_SIZE, default_model_dir, ensure_default_model, parameter_count,
    tensor_shapes, write_checkpoint,
)
from engine.checkpoints import default_model, writer

transformers = pytest.importorskip("transformers")

TINY = ("tiny-llama", "tiny-qwen3-moe", "default")
LARGE = ("qwen3-0.6b", "llama-3.1-8b", "qwen3-30b-a3b")


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            tensors.update({k: h.get_tensor(k) for k in h.keys()})
    return tensors


def file_bytes(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def test_same_arguments_write_identical_bytes(tmp_path, seed):
    kwargs = dict(preset="tiny-qwen3-moe", seed=seed % 1000, shard_bytes=100_000, progress=False)
    a = file_bytes(write_checkpoint(tmp_path / "a", **kwargs))
    b = file_bytes(write_checkpoint(tmp_path / "b", **kwargs))
    assert len(a) > 6 and a == b
    c = file_bytes(write_checkpoint(tmp_path / "c", **{**kwargs, "seed": kwargs["seed"] + 1}))
    assert c["config.json"] == a["config.json"] and c["tokenizer.json"] == a["tokenizer.json"]
    weights = [name for name in a if name.endswith(".safetensors")]
    assert len(weights) > 1 and all(c[name] != a[name] for name in weights)


def test_values_depend_on_seed_and_name_only(tmp_path, seed):
    """A tensor's values are its own: adding layers or changing dtype does not move the others."""
    deeper = {**PRESETS["tiny-llama"], "num_hidden_layers": 3}
    two = read_tensors(write_checkpoint(tmp_path / "two", "tiny-llama", dtype=torch.float32, seed=7, progress=False))
    three = read_tensors(write_checkpoint(tmp_path / "three", deeper, dtype="bfloat16", seed=7, progress=False))
    assert set(two) < set(three)
    for name, t in two.items():
        assert three[name].dtype == torch.bfloat16
        torch.testing.assert_close(three[name], t.to(torch.bfloat16), atol=0, rtol=0)
        if name.endswith("norm.weight"):
            assert torch.all(t == 1.0), name
        else:
            assert abs(t.std().item() - writer.INIT_STD) < 0.1 * writer.INIT_STD, name
            assert abs(t.mean().item()) < 0.01, name
    embed, head = two["model.embed_tokens.weight"], two["lm_head.weight"]
    assert not torch.equal(embed, head)


@pytest.mark.parametrize("preset", TINY)
def test_hf_loads_every_tensor_and_runs(tmp_path, preset, seed):
    path = write_checkpoint(tmp_path / preset, preset, progress=False)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True,
                                                                    dtype=torch.float32)
    assert type(model).__name__ == PRESETS[preset]["architectures"][0]
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    files = read_tensors(path)
    assert {k: tuple(v.shape) for k, v in files.items()} == dict(tensor_shapes(PRESETS[preset]))
    torch.testing.assert_close(model.model.embed_tokens.weight, files["model.embed_tokens.weight"].float())
    assert model.num_parameters() == parameter_count(PRESETS[preset])
    ids = torch.randint(0, TOKENIZER_SIZE, (2, 11))
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (2, 11, PRESETS[preset]["vocab_size"])
    assert torch.isfinite(logits).all() and logits.std() > 1e-3


def test_sharded_checkpoint_has_a_correct_index(tmp_path):
    shard_bytes = 40_000
    path = write_checkpoint(tmp_path / "sharded", "tiny-llama", shard_bytes=shard_bytes, progress=False)
    single = read_tensors(write_checkpoint(tmp_path / "single", "tiny-llama", progress=False))
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(path.glob("*.safetensors"))
    n = len(shards)
    assert n > 2 and [s.name for s in shards] == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert set(index["weight_map"]) == set(single)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in single.values())
    for shard in shards:
        with safe_open(str(shard), framework="pt") as h:
            names = set(h.keys())
            assert names == {k for k, v in index["weight_map"].items() if v == shard.name}
            data = sum(h.get_tensor(k).numel() * 2 for k in names)
            assert data <= shard_bytes or len(names) == 1
            for k in names:
                assert torch.equal(h.get_tensor(k), single[k]), k
    _, info = transformers.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


def test_tokenizer_round_trips_and_templates(tmp_path, seed):
    path = write_checkpoint(tmp_path / "m", "tiny-llama", progress=False)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    assert len(tok) == TOKENIZER_SIZE <= PRESETS["tiny-llama"]["vocab_size"]
    assert tok.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == list(range(len(SPECIAL_TOKENS)))
    rng = random.Random(seed)
    alphabet = "abcdefghij XYZ\n\t.,;:!?0123456789_(){}[]éüß漢字😀"
    text = "".join(rng.choice(alphabet) for _ in range(300)) + " the model writes tokens"
    ids = tok(text).input_ids
    assert len(ids) < len(text.encode())  # the merges do shorten text
    assert all(i >= len(SPECIAL_TOKENS) for i in ids)  # no BOS or EOS added
    assert tok.decode(ids) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    gen = json.loads((path / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")]
    config = json.loads((path / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (
        tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)


@pytest.mark.parametrize("preset", LARGE)
def test_large_presets_match_hf(preset):
    cfg = PRESETS[preset]
    config = transformers.AutoConfig.for_model(**cfg)
    written = config.to_dict()
    renamed = {"num_experts": "num_local_experts"}
    assert {k: written[renamed.get(k, k)] for k in cfg} == cfg
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert type(model).__name__ == cfg["architectures"][0]
    assert model.num_parameters() == parameter_count(cfg)
    if preset != "qwen3-30b-a3b":  # HF fuses the per-expert tensors of the published MoE layout
        hf = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        if cfg["tie_word_embeddings"]:
            del hf["lm_head.weight"]
        assert hf == dict(tensor_shapes(cfg))


def test_published_parameter_counts():
    assert parameter_count(PRESETS["llama-3.1-8b"]) == pytest.approx(8.03e9, rel=1e-3)
    assert parameter_count(PRESETS["qwen3-30b-a3b"]) == pytest.approx(30.5e9, rel=3e-3)
    qwen = PRESETS["qwen3-0.6b"]
    assert parameter_count(qwen) == pytest.approx(0.596e9, rel=1e-3)
    assert parameter_count(qwen) - qwen["vocab_size"] * qwen["hidden_size"] == pytest.approx(0.44e9, rel=1e-2)


def test_interrupted_write_leaves_nothing(tmp_path, monkeypatch):
    real, calls = writer._write_tensor, []

    def failing(*args):
        calls.append(args[1])
        if len(calls) == 5:
            raise KeyboardInterrupt
        real(*args)

    monkeypatch.setattr(writer, "_write_tensor", failing)
    with pytest.raises(KeyboardInterrupt):
        write_checkpoint(tmp_path / "m", "tiny-llama", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_existing_directory_needs_overwrite(tmp_path):
    path = write_checkpoint(tmp_path / "m", "tiny-llama", seed=1, progress=False)
    before = file_bytes(path)
    with pytest.raises(FileExistsError):
        write_checkpoint(path, "tiny-llama", seed=2, progress=False)
    assert file_bytes(path) == before
    write_checkpoint(path, "tiny-llama", seed=2, overwrite=True, progress=False)
    after = file_bytes(path)
    assert after["model.safetensors"] != before["model.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["m"]


def test_bad_presets_are_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown preset"):
        write_checkpoint(tmp_path / "x", "llama-9000")
    with pytest.raises(ValueError, match="vocab_size"):
        write_checkpoint(tmp_path / "x", {**PRESETS["tiny-llama"], "vocab_size": 100})
    with pytest.raises(ValueError, match="architectures"):
        write_checkpoint(tmp_path / "x", {**PRESETS["tiny-llama"], "architectures": ["GPT2LMHeadModel"]})
    assert not (tmp_path / "x").exists()


def test_ensure_default_model_races_and_warns(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path))
    expected = default_model_dir()
    assert expected.parent == tmp_path and expected.name.startswith("default-qwen3-")
    results, errors = [], []
    all_started = threading.Barrier(3)
    real_write = default_model.write_checkpoint

    def racing_write(*args, **kwargs):  # every caller is past the existence check before any writes
        all_started.wait(timeout=30)
        return real_write(*args, **kwargs)

    monkeypatch.setattr(default_model, "write_checkpoint", racing_write)

    def call():
        try:
            results.append(ensure_default_model(progress=False))
        except BaseException as e:  # surfaced below
            errors.append(e)

    with caplog.at_level(logging.WARNING, logger="engine.checkpoints"):
        threads = [threading.Thread(target=call) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors and results == [expected] * 3
    assert [p.name for p in tmp_path.iterdir()] == [expected.name]
    assert any(r.levelno == logging.WARNING and "RANDOM" in r.getMessage() for r in caplog.records)
    written = (expected / "model.safetensors").stat().st_mtime_ns
    assert ensure_default_model(progress=False) == expected
    assert (expected / "model.safetensors").stat().st_mtime_ns == written
    assert json.loads((expected / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
