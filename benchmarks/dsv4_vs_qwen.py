"""DeepSeek-V4 against a dense model of its size, as a new user meets them: ``LLM.generate``.

tiny-dsv4-py and tiny-qwen3-py (../shared/models) in bf16 on the GPU, default backends, each at
batch 1 and 32: 256-token random prompts, 64 new tokens (greedy, ignore_eos, prefix cache off).
Output tokens/s is batch x 64 over the wall time of one ``generate`` after a warm-up call of the
same shape. V4 runs once more on the native V4 attention and mHC oracles, the figure before its
kernels. The goal (issue: DeepSeek-V4 at speed) is V4 within 2x of Qwen3.

    python benchmarks/dsv4_vs_qwen.py --json benchmarks/results/dsv4-vs-qwen-h200.json
"""

from __future__ import annotations

import gc
import random
import time
from pathlib import Path

import torch
from tqdm import tqdm

from engine import LLM, SamplingParams

try:
    from common import bench_main
except ImportError:
    from benchmarks.common import bench_main

MODELS = Path(__file__).resolve().parents[1].parent / "shared" / "models"
PROMPT, NEW, BATCHES = 256, 64, (1, 32)
RUNS = (("qwen3", "tiny-qwen3-py", {}, BATCHES),
        ("dsv4", "tiny-dsv4-py", {}, BATCHES),
        ("dsv4_native_v4_attention", "tiny-dsv4-py", {"v4_attention_backend": "native", "mhc_backend": "native"},
         (1,)))


def _tokens_per_s(llm: LLM, batch: int, vocab: int, rng: random.Random) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)

    def prompts():
        return [[rng.randrange(3, vocab) for _ in range(PROMPT)] for _ in range(batch)]

    llm.generate(prompts(), params, use_tqdm=False)  # warm-up: compilation, first graphs
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate(prompts(), params, use_tqdm=False)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    assert all(len(c.token_ids) == NEW for o in outs for c in o.outputs)
    return batch * NEW / elapsed


def run(device: torch.device) -> dict:
    rng = random.Random(0)
    results = {}
    for key, folder, options, batches in tqdm(RUNS, desc="models"):
        llm = LLM(model=str(MODELS / folder), dtype="bfloat16", device="cuda", enable_prefix_caching=False,
                  **options)
        vocab = llm.engine.model_config.vocab_size
        results[key] = {"backends": {f: s.chosen.name for f, s in llm.engine.components.selections.items()},
                        **{f"batch_{b}_tok_s": round(_tokens_per_s(llm, b, vocab, rng), 1) for b in batches}}
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    ratios = {f"qwen3_over_dsv4_batch_{b}": round(results["qwen3"][f"batch_{b}_tok_s"]
                                                  / results["dsv4"][f"batch_{b}_tok_s"], 2) for b in BATCHES}
    return {"command": "python benchmarks/dsv4_vs_qwen.py", "prompt_tokens": PROMPT, "new_tokens": NEW,
            "runs": results, **ratios}


def lines(result: dict) -> list[str]:
    out = [f"{k}: {v}" for k, v in result["runs"].items()]
    return out + [f"{k}: {v}x (goal: 2x or less)" for k, v in result.items() if k.startswith("qwen3_over")]


if __name__ == "__main__":
    bench_main(run, lines)
