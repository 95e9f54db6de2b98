"""FP8 128x128 block-scaled GEMM on the device against ``torch._scaled_mm`` and bf16 matmul.

``_scaled_mm`` with per-tensor scales is what a user would pick instead (it has no block
scales, so it does less work); bf16 ``torch.matmul`` is the unquantized baseline. The engine's
kernel is timed on pre-quantized operands (the GEMM alone) and as the whole linear (activation
quantization included).

    python benchmarks/gemm_bench.py --json benchmarks/results/gemm-h200.json
"""

from __future__ import annotations

import torch
from tqdm import tqdm

from engine.backends.triton.fp8_gemm import fp8_block_gemm, fp8_block_linear
from engine.backends.triton.fp8_quant import quantize_fp8_token_group
from engine.core.native.quant import dequantize_fp8_block, quantize_fp8_block

try:
    from common import bench_main, bench_ms, measure_limits
except ImportError:
    from benchmarks.common import bench_main, bench_ms, measure_limits

MS = (1, 16, 64, 256, 1024, 4096, 8192)
NKS = ((2048, 2048), (4096, 4096), (8192, 8192), (8192, 2048), (2048, 8192))


def case(m: int, n: int, k: int, device, gen) -> dict:
    x = torch.randn(m, k, dtype=torch.bfloat16, device=device, generator=gen)
    w = torch.randn(n, k, dtype=torch.bfloat16, device=device, generator=gen) / k**0.5
    wq, ws = quantize_fp8_block(w)
    xq, xs = quantize_fp8_token_group(x)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=device)
    gemm = lambda: fp8_block_gemm(xq, xs, wq, ws, torch.bfloat16, out=out)  # noqa: E731
    gemm()
    ref = x.float() @ dequantize_fp8_block(wq, ws).float().t()
    err = ((out.float() - ref).norm() / ref.norm()).item()
    t_gemm = bench_ms(gemm)
    t_linear = bench_ms(lambda: fp8_block_linear(x, wq, ws))
    a8, b8 = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn).t()  # b column-major, as cuBLAS wants
    one = torch.ones((), device=device)
    t_scaled = bench_ms(lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16))
    t_bf16 = bench_ms(lambda: x @ w.t())
    tf = lambda ms: round(2 * m * n * k / ms / 1e9, 2)  # noqa: E731
    return {"m": m, "n": n, "k": k, "gemm_ms": round(t_gemm, 4), "linear_ms": round(t_linear, 4),
            "scaled_mm_ms": round(t_scaled, 4), "bf16_ms": round(t_bf16, 4),
            "gemm_tflop_s": tf(t_gemm), "scaled_mm_tflop_s": tf(t_scaled), "bf16_tflop_s": tf(t_bf16),
            "gemm_vs_scaled_mm": round(t_scaled / t_gemm, 3), "linear_vs_scaled_mm": round(t_scaled / t_linear, 3),
            "rel_err": float(f"{err:.2e}")}


def run(device: torch.device, limits: dict | None = None) -> dict:
    gen = torch.Generator(device=device)
    gen.manual_seed(torch.seed() % 2**31)
    cases = [(m, n, k) for n, k in NKS for m in MS]
    return {"benchmark": "fp8_block_gemm", "limits": limits or measure_limits(device),
            "cases": [case(m, n, k, device, gen) for m, n, k in tqdm(cases, desc="fp8 gemm")]}


def summary(result: dict) -> list[str]:
    return [f"M={r['m']:5d} N={r['n']} K={r['k']}: {r['gemm_tflop_s']:7.1f} TFLOP/s, _scaled_mm "
            f"{r['scaled_mm_tflop_s']:7.1f} ({r['gemm_vs_scaled_mm']:.2f}x), bf16 {r['bf16_tflop_s']:7.1f}"
            for r in result["cases"]]


if __name__ == "__main__":
    bench_main(run, summary)
