"""`engine bench offline`'s workload (nano-vllm's: 256 sequences, prompt and output lengths in
[100, 1024], ignore_eos) on the device, the engine against HF transformers on the same prompts.

HF generates in batches of ``HF_BATCH`` prompts of similar length, left-padded, each batch to its
longest requested output; only the requested tokens count. It runs on the first ``--hf-seqs``
sequences (it is far slower), so the two figures are tokens/s over their own sets.

    python benchmarks/offline_vs_hf.py --json benchmarks/results/offline-h200.json
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import torch

from engine import LLM, SamplingParams
from engine.checkpoints import write_checkpoint
from engine.benchmarks.offline import workload

try:
    from common import bench_main
except ImportError:
    from benchmarks.common import bench_main

PRESET = "qwen3-0.6b"
HF_BATCH = 32
HF_SEQS = 64


def _engine(path: Path, work) -> dict:
    llm = LLM(str(path), dtype="bfloat16", max_model_len=2048)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4))
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=o) for _, o in work]
    torch.cuda.synchronize()
    t = time.perf_counter()
    outs = llm.generate([p for p, _ in work], params)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    backends = {f: s.chosen.name for f, s in llm.engine.components.selections.items()}
    del llm
    torch.cuda.empty_cache()
    return {"seqs": len(work), "output_tokens": tokens, "seconds": round(elapsed, 2),
            "output_tok_s": round(tokens / elapsed, 1), "backends": backends}


def _hf(path: Path, work) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    order = sorted(work, key=lambda w: len(w[0]))
    tokens, elapsed = 0, 0.0
    for i in range(0, len(order), HF_BATCH):
        chunk = order[i:i + HF_BATCH]
        width = max(len(p) for p, _ in chunk)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in chunk], device="cuda")
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk], device="cuda")
        longest = max(o for _, o in chunk)
        torch.cuda.synchronize()
        t = time.perf_counter()
        model.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest, do_sample=True,
                       temperature=0.6, pad_token_id=0)
        torch.cuda.synchronize()
        elapsed += time.perf_counter() - t
        tokens += sum(o for _, o in chunk)
    return {"seqs": len(work), "output_tokens": tokens, "seconds": round(elapsed, 2),
            "output_tok_s": round(tokens / elapsed, 1), "batch": HF_BATCH}


def run(device: torch.device) -> dict:
    path = write_checkpoint(Path(tempfile.mkdtemp(prefix="engine-offline-")) / PRESET, PRESET)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    work = workload(256, 100, 1024, vocab, 0)
    engine = _engine(path, work)
    hf = _hf(path, work[:HF_SEQS])
    return {"benchmark": "offline_vs_hf", "preset": PRESET, "workload": "256 seqs, lengths in [100, 1024]",
            "engine": engine, "hf": hf, "engine_vs_hf": round(engine["output_tok_s"] / hf["output_tok_s"], 2)}


if __name__ == "__main__":
    bench_main(run, lambda r: [f"engine {r['engine']['output_tok_s']} tok/s, HF {r['hf']['output_tok_s']} tok/s "
                               f"({r['engine_vs_hf']}x)"])
