"""DeepSeek-V4-Flash's grouped output projection (wo_a: 8 groups, each [T, 4096] @ [4096, 1024].T) on
MXFP8 against bf16, the two paths ``--mxfp8-attention`` chooses between.

bf16 is what GroupedLinear runs without MXFP8 (``torch.bmm`` over the groups); ``mxfp8`` is the
grouped MXFP8 GEMM on O as the attention's epilogue writes it (E4M3 + E8M0 per 32: on sm_90 its
tiles dequantized in registers into a bf16 wgmma, on sm_100 and gfx950 the block-scaled MMA);
``mxfp8+quant`` adds a separate quantization of a bf16 O, what the path would cost without the
epilogue. Each case's limit is the larger of its bytes (O, wo_a and the output, each in its format)
over the copy bandwidth and its products over the bf16 matrix rate, measured in the same run.

    python benchmarks/mxfp8_wo_a_bench.py --json benchmarks/results/mxfp8-wo-a-h200.json
"""

from __future__ import annotations

import torch

from engine.backends.triton.mxfp8 import mxfp8_grouped_gemm, quantize_mxfp8
from engine.core.native.quant import quantize_fp8_block_e8m0

try:
    from common import bench_main, bench_ms, measure_limits
except ImportError:
    from benchmarks.common import bench_main, bench_ms, measure_limits

GROUPS, K, RANK = 8, 4096, 1024  # V4-Flash: 64 heads of 512 in 8 groups, o_lora_rank 1024
TOKENS = (1, 8, 32, 128, 512, 2048, 8192)
MX_BYTES = 1 + 1 / 32  # an E4M3 value and its share of an E8M0 scale


def case(t: int, device, limits: dict) -> dict:
    o = torch.randn(t, GROUPS, K, dtype=torch.bfloat16, device=device)
    w = torch.randn(GROUPS * RANK, K, dtype=torch.bfloat16, device=device) / K**0.5
    w_data, w_scale = quantize_fp8_block_e8m0(w, block=1, cols=32)
    o_data, o_scale = quantize_mxfp8(o)
    w_t = w.view(GROUPS, RANK, K).transpose(1, 2)
    times = {"bf16": bench_ms(lambda: torch.bmm(o.transpose(0, 1), w_t)),
             "mxfp8": bench_ms(lambda: mxfp8_grouped_gemm(o_data, o_scale, w_data, w_scale)),
             "mxfp8+quant": bench_ms(lambda: mxfp8_grouped_gemm(*quantize_mxfp8(o), w_data, w_scale))}
    flop_ms = 2 * t * GROUPS * K * RANK / limits["bf16_tflop_s"] / 1e9
    out_bytes = t * GROUPS * RANK * 2
    limit = {"bf16": max(flop_ms, ((t * GROUPS * K + GROUPS * RANK * K) * 2 + out_bytes) / limits["copy_gb_s"] / 1e6),
             "mxfp8": max(flop_ms, ((t * GROUPS * K + GROUPS * RANK * K) * MX_BYTES + out_bytes)
                          / limits["copy_gb_s"] / 1e6)}
    return {"tokens": t, **{f"{k}_ms": round(v, 4) for k, v in times.items()},
            "mxfp8_vs_bf16": round(times["bf16"] / times["mxfp8"], 3),
            "bf16_of_limit": round(limit["bf16"] / times["bf16"], 3),
            "mxfp8_of_limit": round(limit["mxfp8"] / times["mxfp8"], 3)}


def run(device: torch.device) -> dict:
    limits = measure_limits(device)
    return {"benchmark": "mxfp8_wo_a", "limits": limits, "cases": [case(t, device, limits) for t in TOKENS]}


def summary(result: dict) -> list[str]:
    return [f"T={r['tokens']:5d}: bf16 {r['bf16_ms']:.4f} ms ({r['bf16_of_limit']:.2f} of limit), mxfp8 "
            f"{r['mxfp8_ms']:.4f} ms ({r['mxfp8_of_limit']:.2f}), {r['mxfp8_vs_bf16']:.2f}x; with a separate quant "
            f"{r['mxfp8+quant_ms']:.4f} ms" for r in result["cases"]]


if __name__ == "__main__":
    bench_main(run, summary)
