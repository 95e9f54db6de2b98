"""Launch parameters of the fused MoE on FP4 experts (DeepSeek-V4's E2M1 + E8M0 per 32) at the
DeepSeek-V4-Flash expert shape (256 experts of 4096 x 2048, top-6): every candidate config at
decode-sized and prefill-sized token counts, each beside the same experts in bf16 through the tuned
table, so the FP4 entries of MOE_FP4_GEMM come from measurements.

An FP4 config is judged by the bytes of the experts the routing touched (packed weights and their
scales) over its time, as a fraction of the copy bandwidth measured in the same run: at decode
sizes the read is the whole cost. Times are device times inside a CUDA graph, four calls on
different routings back to back (their experts past what the L2 holds). Each config's output is
checked against native's dequantized experts before it is timed; a config that fails to compile or
is wrong is reported, not timed.

    python benchmarks/moe_fp4_sweep.py --json benchmarks/results/moe-fp4-sweep-h200.json
"""

from __future__ import annotations

import itertools
import math

import torch
from tqdm import tqdm

from engine.backends.triton.fp8_gemm import GemmConfig
from engine.backends.triton.fused_moe import fused_moe
from engine.core.families.moe import ExpertWeights
from engine.core.native.moe import NativeMoE

try:
    from common import bench_main, graph_ms, measure_limits
    from moe_bench import SHAPES, fp4_experts, random_case, random_experts
except ImportError:
    from benchmarks.common import bench_main, graph_ms, measure_limits
    from benchmarks.moe_bench import SHAPES, fp4_experts, random_case, random_experts

SHAPE = SHAPES["deepseek-v4-flash"]
CALLS = 4  # routings per graph
BANDS = {
    "small": dict(tokens=(1, 16, 128), configs=[GemmConfig(16, bn, bk, 1, w, s) for bn, bk, w, s in itertools.product(
        (64, 128), (128, 256), (4, 8), (3, 4)) if w == 4 or bn == 128]),
    "large": dict(tokens=(1024, 4096), configs=[
        GemmConfig(bm, bn, bk, 8, w, s) for bm, bn, bk, w, s in itertools.product(
            (32, 64, 128), (64, 128), (64, 128), (4, 8), (3, 4)) if (w == 4 or bn == 128) and bm * bk <= 8192]),
}


def _key(c: GemmConfig) -> str:
    return f"{c.block_m}x{c.block_n}x{c.block_k} group {c.group_m} warps {c.num_warps} stages {c.num_stages}"


def _experts(x, weights, ids, w: ExpertWeights, config: GemmConfig | None = None):
    return fused_moe(x, weights, ids, w.gate_up, w.down, swiglu_limit=w.swiglu_limit, gate_up_scale=w.gate_up_scale,
                     down_scale=w.down_scale, config=config)


def _time(cases, ref: torch.Tensor, w: ExpertWeights, config: GemmConfig) -> float | str:
    """Device ms per call, or why the config was not timed (``ref``: native's output on cases[0])."""
    try:
        err = ((_experts(*cases[0], w, config).float() - ref).norm() / ref.norm()).item()
        if not err < 2e-2:
            return f"wrong: relative error {err:.3g}"
        return graph_ms([lambda c=c: _experts(*c, w, config) for c in cases])
    except Exception as e:  # noqa: BLE001 - a config the device cannot run is reported, not fatal
        return f"{type(e).__name__}: {str(e)[:120]}"


def run(device: torch.device) -> dict:
    limits = measure_limits(device)
    w16 = random_experts(SHAPE, device)
    w4 = fp4_experts(w16)
    per_expert = sum(t[0].numel() * t.element_size() for t in (w4.gate_up, w4.down, w4.gate_up_scale, w4.down_scale))
    bands = {}
    for band, spec in BANDS.items():
        rows = []
        for tokens in tqdm(spec["tokens"], desc=f"fp4 moe sweep {band}"):
            cases = [random_case(SHAPE, tokens, device) for _ in range(CALLS)]
            touched = sum(ids.unique().numel() for _, _, ids in cases) / CALLS * per_expert
            bf16 = graph_ms([lambda c=c: _experts(*c, w16) for c in cases])
            ref = NativeMoE(None).experts(*cases[0], w4).float()
            times = {_key(cfg): _time(cases, ref, w4, cfg) for cfg in spec["configs"]}
            ok = {c: t for c, t in times.items() if isinstance(t, float)}
            rows.append({"tokens": tokens, "bf16_ms": round(bf16, 4), "fp4_bytes": int(touched),
                         "fp4_ms": {c: round(t, 4) for c, t in ok.items()},
                         "fp4_fraction_of_copy": {c: round(touched / t / 1e6 / limits["copy_gb_s"], 3)
                                                  for c, t in ok.items()},
                         "not_timed": {c: t for c, t in times.items() if not isinstance(t, float)}})
        score = {c: math.exp(sum(math.log(r["bf16_ms"] / r["fp4_ms"].get(c, 1e9)) for r in rows) / len(rows))
                 for c in map(_key, spec["configs"])}
        best = max(score, key=score.get)
        bands[band] = {"best": best, "best_geomean_bf16_over_fp4": round(score[best], 3),
                       "best_per_tokens": [{"tokens": r["tokens"], "bf16_ms": r["bf16_ms"],
                                            "best": min(r["fp4_ms"], key=r["fp4_ms"].get, default=None),
                                            "fp4_ms": min(r["fp4_ms"].values(), default=None),
                                            "best_overall_fp4_ms": r["fp4_ms"].get(best),
                                            "best_overall_fraction_of_copy": r["fp4_fraction_of_copy"].get(best)}
                                           for r in rows],
                       "rows": rows}
    return {"benchmark": "moe_fp4_sweep", "shape": SHAPE, "limits": limits, "bands": bands}


def _lines(result: dict) -> list[str]:
    out = [f"copy {result['limits']['copy_gb_s']} GB/s"]
    for band, b in result["bands"].items():
        out.append(f"{band}: best {b['best']}: bf16/fp4 time geomean {b['best_geomean_bf16_over_fp4']}")
        out += [f"  {r['tokens']} tokens: fp4 {r['best_overall_fp4_ms']} ms ({r['best_overall_fraction_of_copy']} "
                f"of copy), bf16 {r['bf16_ms']} ms; tokens' best {r['fp4_ms']} ms {r['best']}"
                for r in b["best_per_tokens"]]
    return out


if __name__ == "__main__":
    bench_main(run, _lines)
