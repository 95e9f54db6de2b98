"""CPU time of a 1K-token prefill and of a decode step for a DeepSeek-V4 checkpoint on the native backend,
and the KV bytes a token costs in each component of its cache (in bf16).

A decode step is the difference between generating 9 tokens and 1 from the same prompt, over 8.

    python benchmarks/dsv4_cpu_step.py ../shared/models/tiny-dsv4-py
"""

from __future__ import annotations

import random
import sys
import time

import torch

from engine import LLM, SamplingParams
from engine.core.models.deepseek_v4.cache import component_bytes_per_token


def main(path: str) -> None:
    torch.set_num_threads(2)
    llm = LLM(path, dtype="float32", progress=False, enable_prefix_caching=False)
    rng = random.Random(0)
    prompt = [rng.randrange(10, llm.engine.vocab_size) for _ in range(1024)]
    llm.generate([prompt[:16]], SamplingParams(max_tokens=2, temperature=0))  # warm-up

    def timed(p: list[int], n: int) -> float:
        start = time.perf_counter()
        llm.generate([p], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        return time.perf_counter() - start

    model = llm.engine.runner.model
    per_token = component_bytes_per_token(model.cache_specs, [l.attn.cache for l in model.model.layers],
                                          torch.bfloat16)
    print("KV bytes per token (bf16):", {k: round(v, 1) for k, v in per_token.items()},
          f"total {sum(per_token.values()):.1f}")
    for ctx in (1024, 128):
        one, nine = timed(prompt[:ctx], 1), timed(prompt[:ctx], 9)
        print(f"context {ctx}: prefill {one:.3f} s, decode step {(nine - one) / 8:.3f} s")


if __name__ == "__main__":
    main(sys.argv[1])
