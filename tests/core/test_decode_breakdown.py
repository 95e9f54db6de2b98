"""benchmarks/decode_breakdown.py where no GPU is needed: its arithmetic, its timers, its refusal."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from benchmark_script import BENCHMARKS, load

SCRIPT = BENCHMARKS / "decode_breakdown.py"


@pytest.fixture(scope="module")
def breakdown():
    return load("decode_breakdown")


def test_summary_splits_the_step(breakdown, seed):
    steps = [random.uniform(1e-3, 2e-3) for _ in range(101)]
    parts = {"schedule": [random.uniform(1e-5, 2e-5) for _ in steps], "execute": [random.uniform(5e-5, 9e-5) for _ in steps],
             "sample": [random.uniform(5e-4, 9e-4) for _ in steps], "wait": [random.uniform(1e-5, 9e-5) for _ in steps],
             "stage": [random.uniform(1e-5, 2e-5) for _ in steps],
             "graph_run": [random.uniform(3e-5, 4e-5) for _ in steps]}
    replay = random.uniform(0.3, 0.9)
    s = breakdown.summarize(steps, parts, replay, 0.25)
    step = sorted(steps)[50] * 1e3
    assert s["step_ms"] == pytest.approx(step, abs=1e-4) and s["tok_s"] == pytest.approx(1e3 / step, abs=0.1)
    assert s["host_ms"] == pytest.approx(step - replay, abs=1e-3)
    assert s["host_fraction"] == pytest.approx(1 - replay / step, abs=1e-3)
    for name, ts in parts.items():
        assert s["parts_ms"][name] == pytest.approx(sorted(ts)[50] * 1e3, abs=1e-4)
    outer = ("schedule", "execute", "sample", "wait", "rest")  # stage and graph_run are inside execute
    assert sum(s["parts_ms"][p] for p in outer) == pytest.approx(step, abs=1e-3)  # "rest" is what the parts leave
    assert s["roofline_tok_s"] == 4000.0
    kernels = {"per_run": 3.0, "device_ms_per_run": 0.2, "top": [{"kernel": "k", "per_run": 3.0, "ms_per_run": 0.2}]}
    assert all(line for line in breakdown._case_lines({"preset": "p", **s, "kernels": kernels}))


def test_part_timers_time_each_call_and_put_everything_back(breakdown):
    class Scheduler:
        def schedule(self):
            return "scheduled"

    class Graphs:
        def _stage(self, b):
            return b

        def run(self, b):
            return self._stage(b) + 1

    graphs = Graphs()
    engine = SimpleNamespace(scheduler=Scheduler(), runner=SimpleNamespace(execute=lambda step: graphs.run(step) * 2,
                                                                           graphs=graphs),
                             sampler=lambda logits, rows: (logits, rows))
    execute = engine.runner.execute
    sampler = engine.sampler
    wait = breakdown.SamplerOutput.wait
    with breakdown.PartTimers(engine) as timers:
        for i in range(3):
            assert engine.scheduler.schedule() == "scheduled"
            assert engine.runner.execute(i) == 2 * (i + 1)
        assert engine.sampler(1, 2) == (1, 2)
        out = breakdown.SamplerOutput(torch.tensor([3, 1]))
        assert out.token_ids == [3, 1]
        out.wait()
    assert [len(timers.times[p]) for p in ("schedule", "execute", "sample", "wait", "stage", "graph_run")] \
        == [3, 3, 1, 2, 3, 3]
    assert breakdown.SamplerOutput.wait is wait
    assert all(t >= 0 for ts in timers.times.values() for t in ts)
    assert not vars(engine.scheduler) and engine.runner.execute is execute and engine.sampler is sampler
    assert not vars(graphs)


def test_host_profile_ranks_functions_by_their_own_time(breakdown):
    def slow():
        return sum(i * i for i in range(20000))

    def step():
        slow()
        return [str(i) for i in range(10)]

    rows = breakdown.host_profile(SimpleNamespace(step=step), 4)
    top = rows[0]["function"]  # slow()'s work: its generator, or the sum driving it (which one wins varies with load)
    assert top.endswith("(<genexpr>)") or "slow" in top or "builtins.sum" in top
    by_name = {r["function"].split("(")[-1]: r for r in rows}
    assert by_name["step)"]["calls_per_step"] == 1.0 and by_name["slow)"]["calls_per_step"] == 1.0
    assert [r["us_per_step"] for r in rows] == sorted((r["us_per_step"] for r in rows), reverse=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_refuses_without_cuda():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run([sys.executable, str(SCRIPT), "--json", "/nonexistent/x.json"], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 1 and "needs a CUDA device" in r.stderr
    assert "Traceback" not in r.stderr


def test_sampling_is_greedy_unless_named(breakdown, monkeypatch):
    monkeypatch.delenv("BREAKDOWN_SAMPLING", raising=False)
    assert breakdown.sampling().greedy
    monkeypatch.setenv("BREAKDOWN_SAMPLING", "top_p")
    top_p = breakdown.sampling()
    assert not top_p.greedy and top_p.top_p < 1 and top_p.seed is not None
    monkeypatch.setenv("BREAKDOWN_SAMPLING", "nucleus")
    with pytest.raises(ValueError, match="BREAKDOWN_SAMPLING='nucleus'"):
        breakdown.sampling()
