"""Model logits against HF transformers in fp32, on random tiny checkpoints and the trained one."""

from __future__ import annotations

import math
import random

import pytest
import torch

transformers = pytest.importorskip("transformers")

from engine.checkpoints import write_checkpoint
from engine.core.config import EngineConfig
from engine.core.startup import build
from packed_logits import engine_logits, hf_logits, rel_err
from engine import LLM, SamplingParams

PAGE = 4


def check_model(path, seed: int, max_len: int = 300) -> None:
    c = build(EngineConfig(model=str(path), dtype="float32", page_size=PAGE, num_pages=400), progress=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    rng = random.Random(seed)
    vocab = c.model_config.vocab_size
    lengths = [1, 2, rng.randint(3, 40), rng.randint(41, max_len), max_len]
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in lengths]
    for split in (None, 0.5):
        got = engine_logits(c, prompts, PAGE, split)
        for p, g in zip(prompts, got):
            err = rel_err(g, hf_logits(hf, p))
            assert err < 1e-4, f"length {len(p)} split {split}: relative error {err:.2e}"


@pytest.mark.parametrize("preset", ["tiny-llama", "default", "tiny-qwen3-moe"])
@pytest.mark.parametrize("variant", [0, 1])
def test_random_checkpoint_logits_match_hf(preset, variant, seed, tmp_path):
    path = write_checkpoint(tmp_path / preset, preset, dtype=torch.float32, seed=seed + variant, progress=False)
    check_model(path, seed + variant)


def test_trained_qwen3_logits_match_hf(tiny_qwen3, seed):
    check_model(tiny_qwen3, seed)


def test_perplexity_matches_hf(tiny_qwen3, eval_text):
    llm = LLM(str(tiny_qwen3), dtype="float32", progress=False)
    ids = llm.tokenizer.encode(eval_text)[:4096]
    assert len(ids) == 4096
    out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == 4096
    nll = -sum(lp[t] for lp, t in zip(out.prompt_logprobs[1:], ids[1:])) / (len(ids) - 1)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32)
    with torch.no_grad():
        ref = float(hf(torch.tensor([ids]), labels=torch.tensor([ids])).loss)
    assert math.isfinite(nll)
    assert abs(math.exp(nll) - math.exp(ref)) / math.exp(ref) < 1e-4, (math.exp(nll), math.exp(ref))
