"""Launch parameters of the FP8 block GEMM on the device: every candidate config at decode-sized and
large M, each timed against ``torch._scaled_mm`` on the same shape, so the tuning table's entries
come from measurements. The JSON keeps every timing and, per M band, the config with the best
geometric mean over the shapes.

    python benchmarks/fp8_gemm_sweep.py --json benchmarks/results/fp8-gemm-sweep-h200.json
"""

from __future__ import annotations

import itertools
import math
import time

import torch
from tqdm import tqdm

from engine.backends.triton.fp8_gemm import GemmConfig, fp8_block_gemm
from engine.backends.triton.fp8_quant import quantize_fp8_token_group
from engine.core.native.quant import quantize_fp8_block

try:
    from common import bench_main, bench_ms
except ImportError:
    from benchmarks.common import bench_main, bench_ms

NKS = ((4096, 4096), (8192, 8192), (2048, 8192), (8192, 2048))
BANDS = {
    "small": dict(ms=(16, 64), configs=[GemmConfig(bm, bn, 128, 1, w, s) for bm, bn, w, s in itertools.product(
        (16, 32, 64), (32, 64, 128), (4,), (3, 4))]),
    "large": dict(ms=(1024, 4096, 8192), configs=[GemmConfig(bm, bn, 128, 8, w, s) for bm, bn, w, s in itertools.product(
        (64, 128), (128, 256), (4, 8), (3, 4, 5)) if bm * bn <= 128 * 256]),
}
BUDGET_S = 200  # no shape starts later; the JSON says which were skipped


def _operands(m: int, n: int, k: int, device, gen):
    x = torch.randn(m, k, dtype=torch.bfloat16, device=device, generator=gen)
    w = torch.randn(n, k, dtype=torch.bfloat16, device=device, generator=gen) / k**0.5
    return quantize_fp8_token_group(x), quantize_fp8_block(w), (x.to(torch.float8_e4m3fn),
                                                                 w.to(torch.float8_e4m3fn).t())


def _key(c: GemmConfig) -> str:
    return f"{c.block_m}x{c.block_n}x{c.block_k} group {c.group_m} warps {c.num_warps} stages {c.num_stages}"


def _time(cfg: GemmConfig, xq, xs, wq, ws, out, ref) -> float | None:
    """The config's median ms, or None where it fails to compile or run (shared memory) or is wrong."""
    try:
        fp8_block_gemm(xq, xs, wq, ws, torch.bfloat16, out=out, config=cfg)
        if ((out.float() - ref).norm() / ref.norm()).item() > 1e-2:
            return None
        return bench_ms(lambda: fp8_block_gemm(xq, xs, wq, ws, torch.bfloat16, out=out, config=cfg), rep=40)
    except Exception:  # noqa: BLE001 - a config the device cannot run is skipped, not fatal
        return None


def run(device: torch.device) -> dict:
    gen = torch.Generator(device=device)
    gen.manual_seed(torch.seed() % 2**31)
    one = torch.ones((), device=device)
    bands, skipped, deadline = {}, [], time.monotonic() + BUDGET_S
    for band, spec in BANDS.items():
        rows = []
        shapes = [(m, n, k) for m in spec["ms"] for n, k in NKS]
        for m, n, k in tqdm(shapes, desc=f"fp8 sweep {band}"):
            if time.monotonic() > deadline:
                skipped.append(f"m {m} n {n} k {k}")
                continue
            (xq, xs), (wq, ws), (a8, b8) = _operands(m, n, k, device, gen)
            out = torch.empty(m, n, dtype=torch.bfloat16, device=device)
            scaled = bench_ms(lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16))
            ref = fp8_block_gemm(xq, xs, wq, ws, torch.bfloat16).float()
            times = {_key(cfg): _time(cfg, xq, xs, wq, ws, out, ref) for cfg in spec["configs"]}
            rows.append({"m": m, "n": n, "k": k, "scaled_mm_ms": round(scaled, 4),
                         "vs_scaled_mm": {c: round(scaled / t, 3) for c, t in times.items() if t}})
        if not rows:
            continue
        score = {c: math.exp(sum(math.log(r["vs_scaled_mm"].get(c, 1e-3)) for r in rows) / len(rows))
                 for c in map(_key, spec["configs"])}
        best = max(score, key=score.get)
        bands[band] = {"best": best, "best_geomean_vs_scaled_mm": round(score[best], 3),
                       "best_per_shape": [{"m": r["m"], "n": r["n"], "k": r["k"], "best": max(
                           r["vs_scaled_mm"], key=r["vs_scaled_mm"].get, default=None), "vs_scaled_mm": max(
                           r["vs_scaled_mm"].values(), default=None), "best_overall_vs_scaled_mm":
                           r["vs_scaled_mm"].get(best)} for r in rows],
                       "rows": rows}
    return {"benchmark": "fp8_gemm_sweep", "bands": bands, "skipped_past_budget": skipped}


def _lines(result: dict) -> list[str]:
    out = []
    for band, b in result["bands"].items():
        out.append(f"{band}: best {b['best']} geomean {b['best_geomean_vs_scaled_mm']}x of _scaled_mm")
        out += [f"  m {r['m']} n {r['n']} k {r['k']}: {r['best_overall_vs_scaled_mm']} (shape's best {r['vs_scaled_mm']} "
                f"{r['best']})" for r in b["best_per_shape"]]
    return out


if __name__ == "__main__":
    bench_main(run, _lines)
