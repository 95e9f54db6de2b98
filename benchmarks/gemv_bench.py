"""The decode GEMV on the device: each candidate launch config on the projections of the Qwen3-0.6B
and Llama-3.1-8B shapes at 1, 4 and 8 rows, against ``F.linear`` (cuBLAS) on the same weights, as
a fraction of the copy bandwidth measured in the same run. The gate/up projections run the fused
SiLU-and-mul variant and are compared with ``F.linear`` followed by the Triton SiLU-and-mul.
Times are device times inside a CUDA graph (as decode steps run), each call on its own copy of the
weight so that none is read from the L2. The JSON keeps every timing and the config with the best
geometric mean per row count. Block-FP8 weights (E4M3, 128-blocks, as Llama/Qwen3 FP8 checkpoints
publish them, and V4-Flash's attention projections) run the same shapes through the GEMV's FP8 path
at its tuned config, beside the two launches they took before it (quantize x, then the FP8 block
GEMM), as bytes read (E4M3 weight and its scales) over the copy bandwidth.

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
from engine.backends.triton.fp8_gemm import fp8_block_linear
from engine.backends.triton.gemv import GemvConfig, gemv
from engine.core.native.quant import quantize_fp8_block

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
FP8_SHAPES = {**{name: SHAPES[name] for name in SHAPES if name.startswith("llama-8b") and "lm_head" not in name},
              "v4-flash wq_a": (1024, 4096, False), "v4-flash wq_b": (32768, 1024, False)}
FP8_ROWS = (1, 4, 8)
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


def _fp8_case(name: str, m: int, device, gen, copy_gb_s: float) -> dict:
    """The FP8 GEMV against the two-launch FP8 path on one projection, both as fractions of the copy bandwidth."""
    n, k, fused = FP8_SHAPES[name]
    x = torch.randn(m, k, dtype=torch.bfloat16, device=device, generator=gen)
    data, scale = quantize_fp8_block(torch.randn(n, k, device=device, generator=gen) / k**0.5)
    nbytes = data.numel() + scale.numel() * 4
    copies = [(data, scale)] + [(data.clone(), scale.clone())
                                for _ in range(max(0, min(64, COPIES_BYTES // nbytes) - 1))]

    def two_launch(d, s):
        out = fp8_block_linear(x, d, s)
        return silu_and_mul(out) if fused else out

    ref = two_launch(data, scale).float()
    got = gemv(x, data, silu_mul=fused, scale=scale).float()
    rel = ((got - ref).norm() / ref.norm()).item()  # the two differ by x's quantization in the GEMM
    two_ms = graph_ms([lambda d=d, s=s: two_launch(d, s) for d, s in copies])
    gemv_ms = graph_ms([lambda d=d, s=s: gemv(x, d, silu_mul=fused, scale=s) for d, s in copies])
    ideal_ms = nbytes / (copy_gb_s * 1e6)
    return {"shape": name, "m": m, "n": n, "k": k, "fused_silu": fused, "weight_mb": round(nbytes / 1e6, 1),
            "two_launch_ms": round(two_ms, 4), "two_launch_of_bandwidth": round(ideal_ms / two_ms, 3),
            "gemv_ms": round(gemv_ms, 4), "gemv_of_bandwidth": round(ideal_ms / gemv_ms, 3),
            "gemv_vs_two_launch": round(two_ms / gemv_ms, 3), "rel_diff_vs_two_launch": round(rel, 4)}


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
    fp8 = []
    for m in FP8_ROWS:
        for name in tqdm(FP8_SHAPES, desc=f"fp8 gemv {m} rows"):
            fp8.append(_fp8_case(name, m, device, gen, limits["copy_gb_s"]))
    result["fp8_block128"] = fp8
    return {"benchmark": "gemv", **result}


def _lines(result: dict) -> list[str]:
    out = [f"copy bandwidth {result['limits']['copy_gb_s']} GB/s"]
    for m, band in result["rows"].items():
        out.append(f"{m} rows: best overall {band['best']} ({band['best_geomean_vs_library']}x of the library)")
        out += [f"  {r['shape']}: library {r['library_ms']} ms ({r['library_of_bandwidth']} of bandwidth), gemv "
                f"{r['best_ms']} ms ({r['best_of_bandwidth']}, {r['best']})" for r in band["cases"]]
    out += [f"fp8 {r['shape']} at {r['m']} rows: gemv {r['gemv_ms']} ms ({r['gemv_of_bandwidth']} of bandwidth), "
            f"two launches {r['two_launch_ms']} ms ({r['two_launch_of_bandwidth']}), {r['gemv_vs_two_launch']}x"
            for r in result.get("fp8_block128", [])]
    return out + result.get("skipped", [])


if __name__ == "__main__":
    bench_main(run, _lines)
