"""Engine overhead per step with the model replaced by a zero-cost stand-in.

What remains is everything the engine does around the forward: scheduling, page allocation,
building the batch, sampling, detokenizing and stop checks. Measured in steady decode at batch
1, 64 and 256 (prompts of 128 tokens), as CPU time per step.

    python benchmarks/scheduler_overhead.py [--json benchmarks/results/scheduler_overhead-cpu.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from engine.core.checkpoint_gen import write_checkpoint
from engine.core.config import EngineConfig
from engine.core.engine import LLMEngine
from engine.core.sampling_params import SamplingParams


class StandInModel:
    """Returns zero hidden states and fixed random logits at no model cost."""

    def __init__(self, model) -> None:
        self.backends, self.config = model.backends, model.config
        self.hidden = model.config.hf["hidden_size"]
        self.logits = torch.randn(1, model.config.vocab_size)

    def __call__(self, batch, kv) -> torch.Tensor:
        return torch.zeros(batch.num_tokens, self.hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits.expand(hidden.shape[0], -1)


def measure(model_dir: str, batch: int, steps: int) -> dict:
    engine = LLMEngine(EngineConfig(model=model_dir, dtype="float32", max_num_seqs=batch, page_size=16,
                                    num_pages=batch * 40 + 2), progress=False)
    engine.runner.model = StandInModel(engine.runner.model)
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=steps + 64, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{i}", list(range(3, 131)), params, stream=False)
    while engine.scheduler.waiting or any(s.in_prefill for s in engine.scheduler.running):
        engine.step()
    for _ in range(5):
        engine.step()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for _ in range(steps):
        engine.step()
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    assert engine.scheduler.num_running == batch
    return {"batch": batch, "steps": steps, "cpu_ms_per_step": round(cpu / steps * 1e3, 3),
            "wall_ms_per_step": round(wall / steps * 1e3, 3),
            "cpu_us_per_seq_step": round(cpu / steps / batch * 1e6, 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model = str(write_checkpoint(Path(tmp) / "m", "tiny-llama", dtype=torch.float32, progress=False))
        rows = [measure(model, b, args.steps) for b in (1, 64, 256)]
    for r in rows:
        print(f"batch {r['batch']:>3}: {r['cpu_ms_per_step']:8.3f} ms CPU per step "
              f"({r['cpu_us_per_seq_step']:.1f} us per sequence), wall {r['wall_ms_per_step']:.3f} ms")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {"benchmark": "scheduler_overhead", "device": f"CPU ({platform.processor() or platform.machine()}, "
              "1 torch thread)", "commit": commit, "command": "python benchmarks/scheduler_overhead.py",
              "results": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
