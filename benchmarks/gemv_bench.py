"""The decode GEMV on the device: each candidate launch config on the projections of the Qwen3-0.6B
and Llama-3.1-8B shapes at 1, 4 and 8 rows, against ``F.linear`` (cuBLAS) on the same weights, as
a fraction of the copy bandwidth measured in the same run. The gate/up projections run the fused
SiLU-and-mul variant and are compared with ``F.linear`` followed by the Triton SiLU-and-mul.
Times are device times inside a CUDA graph (as decode steps run), each call on its own copy of the
weight so that none is read from the L2. The JSON keeps every timing and the config with the best
geometric mean per row count.

    python benchmarks/gemv_bench.py --json benchmarks/results/gemv-h200.json
"""

from __future__ import annotations

import itertools
import math
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

from engine.backends.triton.activation import silu_and_mul
from engine.backends.triton.gemv import GemvConfig, gemv

try:
    from common import bench_main, graph_ms, measure_limits
except ImportError:
    from benchmarks.common import bench_main, graph_ms, measure_limits

SHAPES = {  # name: (N, K, fused gate/up); N of a gate/up projection counts both halves
    "qwen3-0.6b qkv": (4096, 1024, False), "qwen3-0.6b o": (1024, 2048, False),
    "qwen3-0.6b gate_up": (6144, 1024, True), "qwen3-0.6b down": (1024, 3072, False),
    "qwen3-0.6b lm_head": (151936, 1024, False),
    "llama-8b qkv": (6144, 4096, False), "llama-8b o": (4096, 4096, False),
    "llama-8b gate_up": (28672, 4096, True), "llama-8b down": (4096, 14336, False),
    "llama-8b lm_head": (128256, 4096, False),
}
CONFIGS = {  # one row: the CUDA-core product; more: tl.dot, whose N is at least 16
    "one_row": [GemvConfig(n, k, w, s) for n, k, w, s in itertools.product((2, 4, 8, 16), (512, 1024, 2048), (4, 8),
                                                                           (1, 3))],
    "rows": [GemvConfig(n, k, w, s) for n, k, w, s in itertools.product((16, 32, 64), (128, 256, 512), (4,), (2, 3, 4))],
}
ROWS = (1, 8, 4)  # four rows time the finalists of eight
FINALISTS = 6
COPIES_BYTES = 400 * 2**20  # weight copies per case: several times the L2
BUDGET_S = 150


def _key(c: GemvConfig) -> str:
    return f"n {c.block_n} k {c.block_k} warps {c.num_warps} stages {c.num_stages}"


def _library(x: torch.Tensor, w: torch.Tensor, fused: bool) -> torch.Tensor:
    return silu_and_mul(F.linear(x, w)) if fused else F.linear(x, w)


def _case(name: str, m: int, configs: list[GemvConfig], device, gen, copy_gb_s: float) -> dict:
    n, k, fused = SHAPES[name]
    x = torch.randn(m, k, dtype=torch.bfloat16, device=device, generator=gen)
    w = torch.randn(n, k, dtype=torch.bfloat16, device=device, generator=gen) / k**0.5
    ws = [w] + [w.clone() for _ in range(max(0, min(64, COPIES_BYTES // (w.numel() * 2)) - 1))]
    ref = _library(x, w, fused).float()
    library = graph_ms([lambda w=w: _library(x, w, fused) for w in ws])
    ideal_ms = w.numel() * 2 / (copy_gb_s * 1e6)
    times = {}
    for cfg in configs:
        try:
            got = gemv(x, w, silu_mul=fused, config=cfg).float()
            if ((got - ref).norm() / ref.norm()).item() > 2e-2:
                continue
            times[_key(cfg)] = graph_ms([lambda w=w: gemv(x, w, silu_mul=fused, config=cfg) for w in ws])
        except Exception:  # noqa: BLE001 - a config the device cannot compile or run is skipped
            continue
    del ws
    best = min(times, key=times.get)
    return {"shape": name, "m": m, "n": n, "k": k, "fused_silu": fused, "weight_mb": round(w.numel() * 2 / 1e6, 1),
            "library_ms": round(library, 4), "library_of_bandwidth": round(ideal_ms / library, 3),
            "best": best, "best_ms": round(times[best], 4), "best_of_bandwidth": round(ideal_ms / times[best], 3),
            "best_vs_library": round(library / times[best], 3), "ms": {c: round(t, 4) for c, t in times.items()}}


def _geomean_best(rows: list[dict]) -> tuple[str, float]:
    keys = set.intersection(*(set(r["ms"]) for r in rows))
    score = {c: math.exp(sum(math.log(r["library_ms"] / r["ms"][c]) for r in rows) / len(rows)) for c in keys}
    best = max(score, key=score.get)
    return best, round(score[best], 3)


def run(device: torch.device) -> dict:
    limits = measure_limits(device)
    gen = torch.Generator(device=device)
    gen.manual_seed(torch.seed() % 2**31)
    deadline, result = time.monotonic() + BUDGET_S, {"limits": limits, "rows": {}}
    finalists = {}
    for m in ROWS:
        configs = finalists.get(m) or CONFIGS["one_row" if m == 1 else "rows"]
        rows = []
        for name in tqdm(SHAPES, desc=f"gemv {m} rows"):
            if time.monotonic() > deadline:
                result.setdefault("skipped", []).append(f"{name} at {m} rows: past the time budget")
                continue
            rows.append(_case(name, m, configs, device, gen, limits["copy_gb_s"]))
        if not rows:
            continue
        best, score = _geomean_best(rows)
        result["rows"][m] = {"best": best, "best_geomean_vs_library": score, "cases": rows}
        ranked = sorted(configs, key=lambda c: -sum(math.log(r["library_ms"] / r["ms"].get(_key(c), 1e9))
                                                    for r in rows))
        if m == 8:
            finalists[4] = ranked[:FINALISTS]
    return {"benchmark": "gemv", **result}


def _lines(result: dict) -> list[str]:
    out = [f"copy bandwidth {result['limits']['copy_gb_s']} GB/s"]
    for m, band in result["rows"].items():
        out.append(f"{m} rows: best overall {band['best']} ({band['best_geomean_vs_library']}x of the library)")
        out += [f"  {r['shape']}: library {r['library_ms']} ms ({r['library_of_bandwidth']} of bandwidth), gemv "
                f"{r['best_ms']} ms ({r['best_of_bandwidth']}, {r['best']})" for r in band["cases"]]
    return out + result.get("skipped", [])


if __name__ == "__main__":
    bench_main(run, _lines)
