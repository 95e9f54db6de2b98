"""Engine logits of packed prompts (optionally in two chunks) and HF's, for the model-vs-HF tests, and
the bound activation quantization sets on them."""

from __future__ import annotations

import torch

from engine.core.forward import ForwardBatch
from engine.core.sampling_params import SamplingParams
from engine.core.sequence import Sequence


# how far a model whose FP8 linears quantize their activations (E4M3, per token and 128 channels: the
# Triton FP8 block GEMM) may move the logits, relative to their largest magnitude, from one whose
# linears do not (the native ones): E4M3 keeps 3 mantissa bits, so each activation is rounded within
# 2**-4 of itself, about uniformly (rms 2**-4 / sqrt(3) = 3.6%), and each projection's output carries
# noise of about that share: tiny-qwen3-py's logits moved by 0.04-0.05 in fp32 and stayed within this
# bound in bf16 on the H100 (test_triton_block_fp8_model)
ACTIVATION_BOUND = 0.08


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())



def engine_logits(c, prompts: list[list[int]], page_size: int, split: float | None = None) -> list[torch.Tensor]:
    """All-position logits of each prompt from one packed batch; ``split`` cuts each prompt in two
    steps, the second over cached context. The KV manager gives each prompt its pages, and the
    windows of all of them (what a step over the whole prompt reads)."""
    seqs = [Sequence(i, f"packed-{i}", 0, p, SamplingParams()) for i, p in enumerate(prompts)]
    assert all(c.kv_manager.allocate(s, len(p)) for s, p in zip(seqs, prompts))
    tables = [c.kv_manager.pages(s) for s in seqs]
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
        batch = ForwardBatch.build(ids, qlens, ctx, tables, page_size, logits_rows, c.device)
        with torch.inference_mode():
            if back := c.model.token_history:  # the ids before each chunk, as the runner passes them
                c.model.stage(ids, qlens, [[-1] * (back - min(back, lo)) + p[max(0, lo - back):lo]
                                           for p, lo in zip(prompts, ctx)])
            batch.attn_metadata = c.model.prepare(batch)
            logits = c.model.compute_logits(c.model(batch, c.kv)[batch.logits_indices])
        start = 0
        for i, q in enumerate(qlens):
            out[i].append(logits[start:start + q])
            start += q
    for s in seqs:
        c.kv_manager.free(s, cache=False)
    return [torch.cat(chunks) for chunks in out]


def hf_logits(model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float()
