"""Where the time of one decode step goes: the graph replay on the GPU, and the host work around it.

For each preset (random bf16 weights), one sequence decodes greedily after a 1K-token prompt with
decode graphs on, and three things are measured:
- the step: wall time of ``engine.step()``, one step after another (each reads a step's sampled
  token back, so over many steps a step's wall time is all of it; with ``overlap_decode`` it
  launches the next step, its input read from the token table, before it does);
- the replay: CUDA events around ``DecodeGraphs.run`` of one prepared decode batch (the sequence's
  last step again: same token, same position, same KV written), run back to back, so the GPU never
  waits on the host and the time per run is the device's;
- the host parts of a step, by wall time of each part: scheduling; ``ModelRunner.execute``
  (gathering the batch, staging it, the copies and the replay's launch: host work only, nothing in
  it waits for the device); the sampler, which launches the argmax, its write into the token
  table and the token's copy back; the wait for that copy (``SamplerOutput.wait``: with
  ``overlap_decode`` a step waits for the tokens of the step before it, which the device computed
  while the host launched this one); and the rest (stop checks, detokenizing, outputs).
Step minus replay is the time the GPU does not spend in the graph: host work not overlapped with
it, plus the sampler's kernel and copies. The roofline is e2e_decode.py's: every weight and the
KV read once, at the measured copy bandwidth. Inside the replay, torch.profiler counts the kernels
one replay runs and their device time by name; the replay's time beyond their sum is the gaps
between kernels. ``BREAKDOWN_PRESETS=qwen3-0.6b`` limits the presets (empty: none);
``BREAKDOWN_MODELS=DIR,DIR`` adds checkpoints as they are; ``BREAKDOWN_SAMPLING=top_p`` decodes
with e2e_decode.py's seeded top-p instead of greedy (the sampler's kernels run outside the graph,
so they show in the step beyond the replay and in the host profile).

    python benchmarks/decode_breakdown.py --json benchmarks/results/decode-breakdown-h200.json
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from engine import LLM, SamplingParams
from engine.checkpoints import write_checkpoint
from engine.core.sampler import SamplerOutput

try:
    from common import bench_main, device_kernels, measure_limits
    from e2e_decode import TOP_P, _prompts, _roofline
except ImportError:
    from benchmarks.common import bench_main, device_kernels, measure_limits
    from benchmarks.e2e_decode import TOP_P, _prompts, _roofline

PRESETS = {"qwen3-0.6b": 300, "llama-3.1-8b": 100}  # preset: decode steps timed
MODEL_STEPS = 300  # decode steps timed for a checkpoint of BREAKDOWN_MODELS
PROFILED_REPLAYS = 20
PROMPT_LEN = 1024
WARMUP_STEPS = 20
REPLAYS = 200
HOST_PROFILE_STEPS, HOST_PROFILE_TOP = 50, 15
PARTS = ("schedule", "execute", "sample", "wait")  # wait: for a step's tokens to reach the host
INNER_PARTS = ("stage", "graph_run")  # inside execute: the staging of the graph's inputs, and it with the launch
SAMPLING = {"greedy": SamplingParams(temperature=0, ignore_eos=True), "top_p": TOP_P}


class PartTimers:
    """Wall time of every call of the engine's scheduler, runner and sampler while it is installed."""

    def __init__(self, engine) -> None:
        self.times: dict[str, list[float]] = {part: [] for part in PARTS + INNER_PARTS}
        graphs = engine.runner.graphs
        self._targets = [("schedule", engine.scheduler, "schedule"), ("execute", engine.runner, "execute"),
                         ("sample", engine, "sampler"), ("wait", SamplerOutput, "wait"), ("stage", graphs, "_stage"),
                         ("graph_run", graphs, "run")]
        self._saved: list[tuple] = []

    def __enter__(self) -> "PartTimers":
        for part, owner, name in self._targets:
            self._saved.append((owner, name, vars(owner).get(name)))  # None: a method of the class
            setattr(owner, name, self._timed(getattr(owner, name), self.times[part]))
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, before in self._saved:
            if before is None:
                delattr(owner, name)
            else:
                setattr(owner, name, before)
        self._saved.clear()

    @staticmethod
    def _timed(fn, out: list[float]):
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                out.append(time.perf_counter() - t)
        return timed


def summarize(step_s: list[float], parts_s: dict[str, list[float]], replay_ms: float, roofline_ms: float) -> dict:
    """Medians in ms; ``host_ms`` is the step beyond the replay's GPU time."""
    ms = lambda xs: round(statistics.median(xs) * 1e3, 4) if xs else 0.0  # noqa: E731 - a part never called
    step = statistics.median(step_s) * 1e3
    parts = {part: ms(ts) for part, ts in parts_s.items()}
    parts["rest"] = round(step - sum(parts[p] for p in PARTS), 4)
    return {"step_ms": round(step, 4), "step_ms_mean": round(statistics.fmean(step_s) * 1e3, 4),
            "tok_s": round(1e3 / step, 1), "replay_gpu_ms": round(replay_ms, 4), "host_ms": round(step - replay_ms, 4),
            "host_fraction": round(1 - replay_ms / step, 3), "parts_ms": parts, "roofline_ms": round(roofline_ms, 4),
            "roofline_tok_s": round(1e3 / roofline_ms, 1)}


def _replay_ms(graphs, token: int, position: int, pages: list[int]) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.inference_mode():
        for _ in range(10):
            graphs.run([token], [position], [pages])
        start.record()
        for _ in range(REPLAYS):
            graphs.run([token], [position], [pages])
        end.record()
        end.synchronize()
    return start.elapsed_time(end) / REPLAYS


def kernel_profile(graphs, token: int, position: int, pages: list[int]) -> dict:
    """The kernels of one replay by name: how many, their device time, the largest first."""
    return device_kernels(lambda: graphs.run([token], [position], [pages]), PROFILED_REPLAYS)


def host_profile(engine, steps: int) -> list[dict]:
    """The host functions of ``steps`` decode steps by their own time, the largest first (cProfile:
    its overhead inflates every call alike, so the ranking holds better than the absolute times)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        engine.step()
    prof.disable()
    stats = pstats.Stats(prof).stats
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:HOST_PROFILE_TOP]
    return [{"function": f"{Path(file).name}:{line}({name})", "calls_per_step": round(calls / steps, 1),
             "us_per_step": round(tottime / steps * 1e6, 1)} for (file, line, name), (_, calls, tottime, *_) in rows]


def _measure(llm: LLM, prompt: list[int], steps: int) -> tuple[list[float], dict[str, list[float]], float, dict, list]:
    engine = llm.engine
    graphs = engine.runner.graphs
    if graphs is None:
        raise RuntimeError("no decode graphs were captured (see the start-up log): there is no replay to time")
    params = dataclasses.replace(sampling(), max_tokens=WARMUP_STEPS + steps + HOST_PROFILE_STEPS + 2)
    engine.add_request("breakdown", prompt, params, stream=False)
    while engine.scheduler.waiting or any(s.in_prefill for s in engine.scheduler.running):
        engine.step()  # the prompt and its first token
    for _ in range(WARMUP_STEPS):
        engine.step()
    step_s = []
    with PartTimers(engine) as timers:
        for _ in range(steps):
            t = time.perf_counter()
            engine.step()
            step_s.append(time.perf_counter() - t)
    profile = host_profile(engine, HOST_PROFILE_STEPS)
    (seq,) = engine.scheduler.running
    last = seq.num_computed - 1  # its last step again: the pages hold that position already
    pages = engine.kv_manager.pages(seq)
    replay = _replay_ms(graphs, seq.tokens[last], last, pages)
    kernels = kernel_profile(graphs, seq.tokens[last], last, pages)
    engine.abort_request("breakdown")
    return step_s, timers.times, replay, kernels, profile


def _case(label: str, path: Path, steps: int, limits: dict) -> dict:
    config = json.loads((path / "config.json").read_text())
    weight_bytes = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    max_len = PROMPT_LEN + WARMUP_STEPS + steps + HOST_PROFILE_STEPS + 16
    llm = LLM(str(path), dtype="bfloat16", enable_prefix_caching=False, max_model_len=max_len, max_num_seqs=1,
              num_pages=-(-max_len // 16) + 8, progress=False)
    prompt = _prompts(1, PROMPT_LEN, config["vocab_size"], 0)[0]
    step_s, parts_s, replay, kernels, profile = _measure(llm, prompt, steps)
    roofline_ms = 1e3 / _roofline(config, 1, PROMPT_LEN + WARMUP_STEPS + steps // 2, limits["copy_gb_s"],
                                  weight_bytes)
    case = {"preset": label, "batch": 1, "steps": steps, "weight_bytes": weight_bytes,
            "backends": {f: s.chosen.name for f, s in llm.engine.components.selections.items()},
            **summarize(step_s, parts_s, replay, roofline_ms), "kernels": kernels, "host_profile": profile}
    for line in _case_lines(case):
        print(line, flush=True)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return case


def sampling() -> SamplingParams:
    """The decode's sampling, as BREAKDOWN_SAMPLING names it (greedy by default)."""
    name = os.environ.get("BREAKDOWN_SAMPLING", "greedy")
    if name not in SAMPLING:
        raise ValueError(f"BREAKDOWN_SAMPLING={name!r}: one of {sorted(SAMPLING)}")
    return SAMPLING[name]


def run(device: torch.device) -> dict:
    """The presets (random weights) named by BREAKDOWN_PRESETS, then the checkpoint directories named
    by BREAKDOWN_MODELS (comma-separated; a trained model's own weights, as served)."""
    limits = measure_limits(device)
    cases = []
    root = Path(tempfile.mkdtemp(prefix="engine-breakdown-"))
    chosen = os.environ.get("BREAKDOWN_PRESETS")
    for preset, steps in PRESETS.items():
        if chosen is not None and preset not in chosen.split(","):
            continue
        cases.append(_case(preset, write_checkpoint(root / preset, preset), steps, limits))
        shutil.rmtree(root / preset)  # the 8B checkpoint is 16 GB of the machine's disk
    for model in filter(None, os.environ.get("BREAKDOWN_MODELS", "").split(",")):
        cases.append(_case(Path(model).name, Path(model), MODEL_STEPS, limits))
    return {"benchmark": "decode_breakdown", "prompt_len": PROMPT_LEN, "replays": REPLAYS, "limits": limits,
            "sampling": os.environ.get("BREAKDOWN_SAMPLING", "greedy"), "cases": cases}


def _case_lines(case: dict) -> list[str]:
    p = case["parts_ms"]
    return [f"{case['preset']} batch 1 after {PROMPT_LEN} tokens: step {case['step_ms']:.3f} ms ({case['tok_s']:.0f} tok/s,"
            f" roofline {case['roofline_tok_s']:.0f}) = graph replay on the GPU {case['replay_gpu_ms']:.3f} ms"
            f" + the rest {case['host_ms']:.3f} ms ({case['host_fraction']:.0%})",
            f"  host parts: schedule {p['schedule']:.3f}, execute {p['execute']:.3f} (graph inputs staged"
            f" {p['stage']:.3f}, launched {p['graph_run'] - p['stage']:.3f}), sample {p['sample']:.3f},"
            f" wait for the tokens {p['wait']:.3f}, rest {p['rest']:.3f} ms",
            f"  replay: {case['kernels']['per_run']:.0f} kernels, {case['kernels']['device_ms_per_run']:.3f} ms"
            " of kernel time; largest: " + "; ".join(f"{k['kernel'][:40]} x{k['per_run']:.0f} {k['ms_per_run']:.3f} ms"
                                                   for k in case["kernels"]["top"][:6]),
            "  host, by own time per step (cProfile): " + "; ".join(f"{h['function']} {h['us_per_step']:.0f} us"
                                                                     for h in case.get("host_profile", [])[:8])]


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("decode_breakdown.py times CUDA graph replays and needs a CUDA device; none is visible here")
    bench_main(run, lambda result: [])
