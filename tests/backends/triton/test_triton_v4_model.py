"""A DeepSeek-V4 model on the Triton V4 attention and mHC families in the interpreter, through the
engine: greedy-identical to the native families over a batch with chunked prefill inside
compression windows, decodes beside prefills, and prefix hits; in the model's dtype and in
DeepSeek's published FP8 layout, where the indexer's keys are E4M3 with their scales in both
families; the same for a random DeepSeek-V4.1 (CSA2 at ratios 1 and 2, entries and index keys
shared across layers, the candidate filter); and tiny-dsv4-py on the Triton mHC (its sublayer boundaries fused: each post writes the
next mix's partials, each pre and the head run the norm after them).

The Triton descriptors refuse a CPU, so a test plugin offers the same backends under the same
names on the CPU, where their kernels run in the interpreter; ``v4_attention_backend="triton"``
and ``mhc_backend="triton"`` then select them as the CUDA and ROCm plugins' descriptors would on
their devices.
"""

from __future__ import annotations

import random
import shutil
import types

import pytest
import torch

pytest.importorskip("transformers")

from dsv4_random import random_checkpoint
from dsv41_random import random_v41_checkpoint, v41_config

from engine.backends.triton.mhc import TritonMHC
from engine.backends.triton.v4_attention import TritonV4Attention
from engine.core.config import EngineConfig
from engine.core.engine import LLMEngine
from engine.core.hookspecs import hookimpl
from engine.core.models.deepseek_v4.cache import entries_of
from engine.core.models.deepseek_v4.publish import write_published
from engine.core.native.quant import FP8
from engine.core.plugins import load_plugins
from engine.core.registry import Descriptor
from engine.core.sampling_params import SamplingParams


def interpreted_triton() -> types.ModuleType:
    module = types.ModuleType("interpreted_triton_v4")

    @hookimpl
    def engine_register_v4_attention_backends():
        return [Descriptor("v4_attention", "triton", TritonV4Attention)]

    @hookimpl
    def engine_register_mhc_backends():
        return [Descriptor("mhc", "triton", TritonMHC)]

    module.engine_register_v4_attention_backends = engine_register_v4_attention_backends
    module.engine_register_mhc_backends = engine_register_mhc_backends
    return module


def generate(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
    return [outs[str(i)] for i in range(len(prompts))]


@pytest.mark.interpret
@pytest.mark.parametrize("published", [False, True])
def test_v4_model_on_triton_attention_and_mhc_is_greedy_identical_to_native(seed, tmp_path, shared_dir, published):
    path = random_checkpoint(tmp_path / "v4", seed, ["heavily_compressed_attention", "compressed_sparse_attention",
                                                     "sliding_attention"], ["moe", "hash_moe", "moe"], hc_mult=2,
                             window=8, csa_rate=4, hca_rate=8, moe_intermediate_size=32)
    for f in ("tokenizer.json", "tokenizer_config.json"):  # the engine reads one; the ids stay below 128
        shutil.copy(shared_dir / "models" / "tiny-dsv4-py" / f, path / f)
    if published:
        write_published(path, tmp_path / "published")
        path = tmp_path / "published"
    greedy_identical(path, published, seed, "layers.1.attn")


def greedy_identical(path, published: bool, seed: int, indexer: str, mhc: bool = True) -> None:
    """The checkpoint at ``path`` on the native and the Triton V4 attention (and ``mhc``: mHC) families:
    greedy tokens equal over a batch with chunked prefill (chunks of 6 on pages of 4, so chunks start
    inside compression windows), decodes beside prefills and a prefix hit. ``indexer``: a layer whose
    index keys are E4M3 with scales where ``published``."""
    rng = random.Random(seed)
    base = [rng.randrange(128) for _ in range(rng.randint(18, 30))]
    batch = [base + [rng.randrange(128) for _ in range(rng.randint(5, 20))],
             [rng.randrange(128) for _ in range(rng.randint(2, 9))],
             base[:rng.randint(9, 17)] + [rng.randrange(128) for _ in range(11)]]
    tokens = []
    for name in ("native", "triton"):
        config = EngineConfig(model=str(path), dtype="float32", device="cpu", page_size=4, chunked_prefill_size=6,
                              max_num_batched_tokens=16, num_pages=96, v4_attention_backend=name,
                              mhc_backend=name if mhc else "native")
        engine = LLMEngine(config, plugins=load_plugins(extra=[interpreted_triton()]), progress=False)
        selections = engine.components.selections
        assert selections["v4_attention"].chosen.name == name
        assert selections["mhc"].chosen.name == (name if mhc else "native")
        assert type(engine.components.model.model.attention).__name__ == (
            "TritonV4Attention" if name == "triton" else "NativeV4Attention")
        index_keys = engine.components.model.get_submodule(f"model.{indexer}").cache.index_keys
        keys, scales = entries_of(engine.components.kv, index_keys)
        assert keys.dtype == (FP8 if published else torch.float32) and (scales is not None) == published
        outs = generate(engine, [base], 5) + generate(engine, batch, 6)
        # base's pages serve a prefix hit: its page-aligned part, which may end inside a compression window
        assert outs[1].num_cached_tokens == len(base) // 4 * 4
        tokens.append([o.outputs[0].token_ids for o in outs])
        if published:  # the keys really were written: E4M3 codes and a scale per closed window
            assert (scales > 0).any() and keys.view(torch.uint8).any()
    assert tokens[1] == tokens[0]


# DeepSeek-V4.1: ratio 2 KV and index source, then Reuse; ratio 1 KV, index and candidate source;
# Reindex inside its candidates; ratio 1 Reuse of the Reindex layer's picks; ratio 2 with no indexer
V41 = dict(ratios=[2, 2, 1, 1, 1, 2], kv_sources=[0, 2, 5], index_sources=[0, 2, 3], candidate=2, blocks=2,
           block_size=2, top_k=3, moe_intermediate_size=32)


@pytest.mark.interpret
def test_v41_model_on_triton_attention_is_greedy_identical_to_native(seed, tmp_path, shared_dir):
    """The Triton mHC is the V4 test's; the CSA2 kernels' E4M3 index keys are test_triton_v4_compressor's
    (and the GPU test's, on the published layout)."""
    path = random_v41_checkpoint(tmp_path / "v41", seed, v41_config(**V41), shared_dir / "models" / "tiny-dsv4-py")
    greedy_identical(path, False, seed, "layers.2.attn", mhc=False)


@pytest.mark.interpret
def test_tiny_dsv4_on_the_triton_mhc_is_greedy_identical_to_native(seed, shared_dir):
    """The trained checkpoint (4 streams of 256) in fp32, prompts of random lengths decoded together."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, 4096) for _ in range(rng.randint(1, 24))] for _ in range(2)]
    tokens = []
    for name in ("native", "triton"):
        config = EngineConfig(model=str(shared_dir / "models" / "tiny-dsv4-py"), dtype="float32", device="cpu",
                              page_size=16, num_pages=16, mhc_backend=name)
        engine = LLMEngine(config, plugins=load_plugins(extra=[interpreted_triton()]), progress=False)
        assert type(engine.components.model.model.layers[0].mhc).__name__ == (
            "TritonMHC" if name == "triton" else "NativeMHC")
        tokens.append([o.outputs[0].token_ids for o in generate(engine, prompts, 5)])
    assert tokens[1] == tokens[0]
