"""A DeepSeek-V4 model on the Triton V4 attention and mHC families in the interpreter, through the
engine: greedy-identical to the native families over a batch with chunked prefill inside
compression windows, decodes beside prefills, and prefix hits; in the model's dtype and in
DeepSeek's published FP8 layout, where the indexer's keys are E4M3 with their scales in both
families; the same for a random DeepSeek-V4.1 (CSA2 at ratios 1 and 2, entries and index keys
shared across layers, the candidate filter); tiny-dsv4-py on the Triton mHC (its sublayer boundaries
fused: each post writes the next mix's partials, each pre and the head run the norm after them);
and tiny-dsv4-py with the attention emitting MXFP8 into the grouped MXFP8 output projection,
against its definition and within the stated cost of the unquantized path.

The Triton descriptors refuse a CPU, so a test plugin (interpreted_triton.py) offers the same
backends on the CPU, where their kernels run in the interpreter.
"""

from __future__ import annotations

import random
import shutil

import pytest
import torch

pytest.importorskip("transformers")

from dsv4_random import random_checkpoint
from dsv41_random import random_v41_checkpoint, v41_config
from interpreted_triton import interpreted_triton
from mxfp8_cost import ARGMAX_AGREEMENT, MAX_LOGIT_ERROR, MEAN_LOGIT_ERROR, PAGE, held_out_prompts, make_engine
from packed_logits import engine_logits

from engine.core.config import EngineConfig
from engine.core.engine import LLMEngine
from engine.core.models.deepseek_v4.attention import GroupedLinear
from engine.core.models.deepseek_v4.cache import entries_of
from engine.core.models.deepseek_v4.publish import write_published
from engine.core.native import quant
from engine.core.native.quant import FP8
from engine.core.plugins import load_plugins
from engine.core.sampling_params import SamplingParams


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
    base = [rng.randrange(128) for _ in range(rng.randint(13, 21))]  # its hit ends at 12, 16 or 20
    batch = [base + [rng.randrange(128) for _ in range(rng.randint(3, 9))],
             [rng.randrange(128) for _ in range(rng.randint(2, 7))],
             base[:rng.randint(9, 13)] + [rng.randrange(128) for _ in range(5)]]
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
        outs = generate(engine, [base], 2) + generate(engine, batch, 3)
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
    """The trained checkpoint (4 streams of 256) in fp32, prompts of random lengths decoded together
    (a step of both: each mHC launch costs seconds in the interpreter)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, 4096) for _ in range(rng.randint(1, 24))] for _ in range(2)]
    tokens = []
    for name in ("native", "triton"):
        config = EngineConfig(model=str(shared_dir / "models" / "tiny-dsv4-py"), dtype="float32", device="cpu",
                              page_size=16, num_pages=16, mhc_backend=name)
        engine = LLMEngine(config, plugins=load_plugins(extra=[interpreted_triton()]), progress=False)
        assert type(engine.components.model.model.layers[0].mhc).__name__ == (
            "TritonMHC" if name == "triton" else "NativeMHC")
        tokens.append([o.outputs[0].token_ids for o in generate(engine, prompts, 2)])
    assert tokens[1] == tokens[0]


def quantized_then_dequantized(self, x: torch.Tensor, then) -> torch.Tensor:
    """GroupedLinear.forward on O and wo_a each quantized and dequantized by core/native (O as the
    attention epilogue quantizes it, the weight as keep_mxfp8 does), then wo_b: the definition of
    the MXFP8 path."""
    data, scale = quant.quantize_mxfp8(x)
    w_data, w_scale = quant.quantize_fp8_block_e8m0(self.weight, 1, 32)
    w = quant.dequantize_fp8_block_e8m0(w_data, w_scale, 1, cols=32).view(self.groups, -1, x.shape[-1])
    return then(torch.bmm(quant.dequantize_mxfp8(data, scale).transpose(0, 1), w.transpose(1, 2)).transpose(0, 1)
                .flatten(1))


@pytest.mark.interpret
def test_tiny_dsv4_mxfp8_attention_interpreted(seed, shared_dir, eval_text, monkeypatch):
    """tiny-dsv4-py in fp32 with the Triton V4 attention emitting MXFP8 into the grouped MXFP8 GEMM:
    its logits are the unquantized engine's with O and wo_a quantized and dequantized by core/native
    before the projection (to fp32 sums: the epilogue, the GEMM and the wiring do what the definition
    says), and their distance from the unquantized path is within the bound tests/mxfp8_cost.py's
    figures set (README: MXFP8 attention output)."""
    model = str(shared_dir / "models" / "tiny-dsv4-py")
    off, on = (make_engine(model, "cpu", mxfp8, pages=4) for mxfp8 in (False, True))
    prompt = held_out_prompts(off, eval_text, 1, 24, seed)
    got = engine_logits(on.components, prompt, PAGE)[0]
    unquantized = engine_logits(off.components, prompt, PAGE)[0]
    monkeypatch.setattr(GroupedLinear, "forward", quantized_then_dequantized)
    defined = engine_logits(off.components, prompt, PAGE)[0]
    torch.testing.assert_close(got, defined, rtol=1e-4, atol=1e-4)
    error = (got - unquantized).abs()
    assert error.mean() < MEAN_LOGIT_ERROR and error.max() < MAX_LOGIT_ERROR
    assert (got.argmax(-1) == unquantized.argmax(-1)).float().mean() >= ARGMAX_AGREEMENT
