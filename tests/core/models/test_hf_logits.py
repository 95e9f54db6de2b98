"""Model logits against HF transformers in fp32, on random tiny checkpoints and the trained one."""

from __future__ import annotations

import math
import random

import pytest
import torch

transformers = pytest.importorskip("transformers")

from engine.core.checkpoint_gen import write_checkpoint
from engine.core.config import EngineConfig
from engine.core.forward import ForwardBatch
from engine.core.startup import build
from engine import LLM, SamplingParams

PAGE = 4


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def engine_logits(c, prompts: list[list[int]], split: float | None = None) -> list[torch.Tensor]:
    """All-position logits of each prompt from one packed batch (two, when ``split`` chunks them)."""
    tables, next_page = [], 1
    for p in prompts:
        n = -(-len(p) // PAGE)
        tables.append(list(range(next_page, next_page + n)))
        next_page += n
    assert next_page <= c.kv.num_pages
    cuts = [0 if split is None else int(len(p) * split) for p in prompts]
    out = [[] for _ in prompts]
    for lo_of, hi_of in ((lambda i: 0, lambda i: cuts[i]), (lambda i: cuts[i], lambda i: len(prompts[i]))):
        ids, qlens, ctx, logits_rows = [], [], [], []
        for i, p in enumerate(prompts):
            lo, hi = lo_of(i), hi_of(i)
            logits_rows.extend(range(len(ids), len(ids) + hi - lo))
            ids.extend(p[lo:hi])
            qlens.append(hi - lo)
            ctx.append(lo)
        if not ids:
            continue
        batch = ForwardBatch.build(ids, qlens, ctx, tables, PAGE, logits_rows)
        with torch.inference_mode():
            batch.attn_metadata = c.model.backends.attention.prepare(batch)
            logits = c.model.compute_logits(c.model(batch, c.kv)[batch.logits_indices])
        start = 0
        for i, q in enumerate(qlens):
            out[i].append(logits[start:start + q])
            start += q
    return [torch.cat(chunks) for chunks in out]


def hf_logits(model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float()


def check_model(path, seed: int, max_len: int = 300) -> None:
    c = build(EngineConfig(model=str(path), dtype="float32", page_size=PAGE, num_pages=400), progress=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    rng = random.Random(seed)
    vocab = c.model_config.vocab_size
    lengths = [1, 2, rng.randint(3, 40), rng.randint(41, max_len), max_len]
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in lengths]
    for split in (None, 0.5):
        got = engine_logits(c, prompts, split)
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
