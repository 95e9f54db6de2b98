"""`engine bench offline`: the nano-vllm workload (random prompts and output lengths, ignore_eos)."""

from __future__ import annotations

import argparse
import json
import platform as host
import random
import subprocess
import time
from dataclasses import asdict
from pathlib import Path

from ..server.engine_args import engine_config


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def workload(num_seqs: int, min_len: int, max_len: int, vocab: int, seed: int) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) pairs, as nano-vllm's bench.py draws them."""
    rng = random.Random(seed)
    return [([rng.randint(0, vocab - 1) for _ in range(rng.randint(min_len, max_len))], rng.randint(min_len, max_len))
            for _ in range(num_seqs)]


def run_offline_bench(args: argparse.Namespace) -> int:
    from ..core.llm import LLM
    from ..core.sampling_params import SamplingParams

    commit = _commit()  # the code that runs, even if the tree moves on during a long run
    config = engine_config(args)
    fields = asdict(config)
    llm = LLM(fields.pop("model"), **fields)
    engine = llm.engine
    vocab = min(engine.vocab_size, engine.tokenizer.vocab_size)
    work = workload(args.num_seqs, args.min_len, args.max_len, vocab, args.bench_seed)
    room = engine.max_model_len
    work = [(p[: room - 1], min(o, room - min(len(p), room - 1))) for p, o in work]
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4))  # warm-up
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=o) for _, o in work]
    start = time.perf_counter()
    outs = llm.generate([p for p, _ in work], params)
    elapsed = time.perf_counter() - start
    out_tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    in_tokens = sum(len(p) for p, _ in work)
    result = {
        "benchmark": "offline", "num_seqs": len(work), "input_tokens": in_tokens, "output_tokens": out_tokens,
        "seconds": round(elapsed, 3), "output_tokens_per_s": round(out_tokens / elapsed, 2),
        "total_tokens_per_s": round((in_tokens + out_tokens) / elapsed, 2),
        "model": config.model, "architecture": engine.model_config.architecture,
        "dtype": str(engine.model_config.dtype), "device": engine.components.platform.summary(),
        "host": host.processor() or host.machine(), "preemptions": engine.scheduler.stats.num_preemptions,
        "backends": {f: s.chosen.name for f, s in engine.components.selections.items()}, "commit": commit,
    }
    print(f"{out_tokens} output tokens from {len(work)} sequences in {elapsed:.2f}s: "
          f"{result['output_tokens_per_s']:.1f} output tokens/s ({result['total_tokens_per_s']:.1f} total tokens/s)")
    if (spec := engine.stats().spec) is not None:
        result["spec_decode"] = {"num_drafts": spec.num_drafts, "num_draft_tokens": spec.num_draft_tokens,
                                 "num_accepted_tokens": spec.num_accepted_tokens,
                                 "mean_acceptance_length": round(spec.mean_acceptance_length, 3)}
        print(f"speculative decoding: mean acceptance length {spec.mean_acceptance_length:.2f} "
              f"({spec.num_accepted_tokens} of {spec.num_draft_tokens} drafts kept)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0
