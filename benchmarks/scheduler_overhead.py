"""Engine overhead per step with the model replaced by a zero-cost stand-in.

What remains is everything the engine does around the forward: scheduling, page allocation,
building the batch, sampling, detokenizing and stop checks. Measured in steady decode at batch
1, 64 and 256 (prompts of 128 tokens), as CPU time per step (the median of 5 runs of 10), three
ways: sampled (temperature 0.8, top-p 0.95) eager steps; greedy eager steps; and greedy steps
through the decode graphs, as on a GPU, with each replay re-running the stand-in (the host work
of staging a step's buffers is all there; the launch and the device copy are not), with decode
steps launched ahead (``overlap_decode``, the default) and without. With ``--bytecodes``, also the
Python bytecodes executed per sequence per step over 10 more steps (``sys.settrace`` opcode events;
the work inside torch, numpy and the tokenizer is not counted): a figure a shared machine's load
does not move.

    python benchmarks/scheduler_overhead.py [--bytecodes] [--json benchmarks/results/scheduler_overhead-cpu.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from engine.checkpoints import write_checkpoint
from engine.core.config import EngineConfig
from engine.core.engine import LLMEngine
from engine.core.families.graphs import GraphBackend
from engine.core.graph_choice import GraphChoice
from engine.core.graph_runner import DecodeGraphs
from engine.core.sampling_params import SamplingParams

MODES = {"sampled": (SamplingParams(temperature=0.8, top_p=0.95), False, True),
         "greedy": (SamplingParams(temperature=0), False, True),
         "greedy_graphs": (SamplingParams(temperature=0), True, True),
         "greedy_graphs_no_overlap": (SamplingParams(temperature=0), True, False)}


class StandInModel:
    """Returns zero hidden states and fixed random logits at no model cost.

    The logits are seeded, so every run's greedy rows repeat the same token. Unseeded, one run in
    four drew one of tiny-llama's 128 byte tokens (of 512), whose repeats never complete a
    character: the detokenizer's window then grew by a token every step, and its cost with it.
    """

    def __init__(self, model) -> None:
        self.backends, self.config = model.backends, model.config
        self.hidden = model.config.hf["hidden_size"]
        self.logits = torch.randn(1, model.config.vocab_size, generator=torch.Generator().manual_seed(0))

    def prepare(self, batch):
        return self.backends.attention.prepare(batch)  # the model's per-step host work, kept

    def __call__(self, batch, kv) -> torch.Tensor:
        return torch.zeros(batch.num_tokens, self.hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits.expand(hidden.shape[0], -1)


class ReplayByRerun(GraphBackend):
    name = "rerun"

    def capture(self, fn):
        fn()
        return fn


def count_bytecodes(engine: LLMEngine, steps: int) -> int:
    """Python bytecodes executed over ``steps`` steps."""
    n = 0

    def local(frame, event, arg):
        nonlocal n
        n += event == "opcode"
        return local

    def call(frame, event, arg):
        frame.f_trace_opcodes, frame.f_trace_lines = True, False
        return local

    before = sys.gettrace()
    sys.settrace(call)
    try:
        for _ in range(steps):
            engine.step()
    finally:
        sys.settrace(before)
    return n


def measure(model_dir: str, mode: str, batch: int, steps: int, windows: int, bytecodes: bool = False) -> dict:
    """Medians over ``steps`` split into ``windows`` runs (a shared machine's noise hits some of them)."""
    sampling, graphs, overlap = MODES[mode]
    engine = LLMEngine(EngineConfig(model=model_dir, dtype="float32", max_num_seqs=batch, page_size=16,
                                    num_pages=batch * 40 + 2, overlap_decode=overlap), progress=False)
    model = engine.runner.model = StandInModel(engine.runner.model)
    if graphs:
        graphs = DecodeGraphs(model, engine.runner.kv, ReplayByRerun(None), 16, engine.max_model_len, batch,
                              engine.device)
        graphs.capture(progress=False)
        engine.runner.choice = GraphChoice([graphs, None, None])
    params = SamplingParams(temperature=sampling.temperature, top_p=sampling.top_p,
                            max_tokens=steps + 64 + (10 if bytecodes else 0), ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{i}", list(range(3, 131)), params, stream=False)
    while engine.scheduler.waiting or any(s.in_prefill for s in engine.scheduler.running):
        engine.step()
    for _ in range(5):
        engine.step()
    cpus, walls, per = [], [], steps // windows
    for _ in range(windows):
        cpu0, wall0 = time.process_time(), time.perf_counter()
        for _ in range(per):
            engine.step()
        cpus.append((time.process_time() - cpu0) / per)
        walls.append((time.perf_counter() - wall0) / per)
    assert engine.scheduler.num_running == batch
    cpu = statistics.median(cpus)
    row = {"mode": mode, "batch": batch, "steps": steps, "windows": windows, "cpu_ms_per_step": round(cpu * 1e3, 3),
           "cpu_ms_per_step_min": round(min(cpus) * 1e3, 3), "wall_ms_per_step": round(statistics.median(walls) * 1e3, 3),
           "cpu_us_per_seq_step": round(cpu / batch * 1e6, 2)}
    if bytecodes:
        row["bytecodes_per_seq_step"] = round(count_bytecodes(engine, 10) / 10 / batch)
        assert engine.scheduler.num_running == batch
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--windows", type=int, default=5)
    ap.add_argument("--bytecodes", action="store_true", help="also count Python bytecodes per sequence per step")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model = str(write_checkpoint(Path(tmp) / "m", "tiny-llama", dtype=torch.float32, progress=False))
        rows = [measure(model, mode, b, args.steps, args.windows, args.bytecodes) for mode in MODES for b in (1, 64, 256)]
    for r in rows:
        print(f"{r['mode']:>13} batch {r['batch']:>3}: {r['cpu_ms_per_step']:8.3f} ms CPU per step "
              f"(min {r['cpu_ms_per_step_min']:.3f}; {r['cpu_us_per_seq_step']:.1f} us per sequence), "
              f"wall {r['wall_ms_per_step']:.3f} ms" + (f", {r['bytecodes_per_seq_step']} bytecodes per sequence"
                                                          if args.bytecodes else ""))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {"benchmark": "scheduler_overhead", "device": f"CPU ({platform.processor() or platform.machine()}, "
              "1 torch thread)", "commit": commit, "command": "python benchmarks/scheduler_overhead.py",
              "results": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
