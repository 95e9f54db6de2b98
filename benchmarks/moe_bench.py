"""Fused MoE experts (Triton) against ``torch._grouped_mm`` and a per-expert loop.

Expert compute only (routing excluded), bf16, at Qwen3-30B-A3B and DeepSeek-V4-Flash expert shapes,
1 to 4096 tokens with uniform random routing. Each method is timed end to end as a user would
call it (sorting by expert, both GEMMs, SwiGLU, the weighted top-k sum) with CUDA events: warm-up,
then the median of repeats; the methods with no host sync are also timed replayed from a CUDA
graph, as a captured step runs them. TFLOP/s counts 6 * T * top_k * H * I (gate/up and down);
GB/s counts the weights of the experts the routing touched, the bound at decode sizes.

    python benchmarks/moe_bench.py [--json benchmarks/results/moe-<device>.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path

import torch

from engine.core.families.moe import ExpertWeights
from engine.core.native.moe import NativeMoE, _swiglu

SHAPES = {
    "qwen3-30b-a3b": dict(num_experts=128, top_k=8, hidden=2048, inner=768, swiglu_limit=None),
    "deepseek-v4-flash": dict(num_experts=256, top_k=6, hidden=4096, inner=2048, swiglu_limit=10.0),
}
TOKENS = (1, 16, 128, 1024, 4096)


def grouped_mm_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w: ExpertWeights) -> torch.Tensor:
    """The experts through ``torch._grouped_mm(mat_a [M, K], mat_b [G, K, N], offs=[G] int32 ends)``:
    rows sorted by expert, both GEMMs grouped, SwiGLU and the weighted sum in torch."""
    num_tokens, top_k = ids.shape
    num_experts = w.gate_up.shape[0]
    flat = ids.reshape(-1)
    order = flat.argsort(stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
    offs = counts.cumsum(0).int()
    gate_up = torch._grouped_mm(x[order // top_k], w.gate_up.transpose(1, 2), offs=offs)
    down = torch._grouped_mm(_swiglu(gate_up, w), w.down.transpose(1, 2), offs=offs)
    out = torch.empty_like(down)
    out[order] = down
    return (out.view(num_tokens, top_k, -1).float() * weights[..., None]).sum(dim=1).to(x.dtype)


def fused_experts(x, weights, ids, w: ExpertWeights) -> torch.Tensor:
    from engine.backends.triton.fused_moe import fused_moe

    return fused_moe(x, weights, ids, w.gate_up, w.down, activation=w.activation, swiglu_limit=w.swiglu_limit)


METHODS = {
    "triton_fused": fused_experts,
    "torch_grouped_mm": grouped_mm_experts,
    "per_expert_loop": lambda x, weights, ids, w: NativeMoE(None).experts(x, weights, ids, w),
}
CAPTURABLE = ("triton_fused", "torch_grouped_mm")  # no host sync; the loop reads the counts on the host


def graphed(fn, device: torch.device):
    """``fn`` captured in a CUDA graph, returned as its replay: what a captured decode step pays,
    without the host's launch overhead (which dominates eager timings at small token counts)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        fn()  # compiles and allocates outside the capture
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def time_ms(fn, device: torch.device, warmup: int = 5, repeats: int = 20) -> float:
    """Median milliseconds per call: CUDA events on a GPU, the wall clock elsewhere."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def random_case(shape: dict, num_tokens: int, device: torch.device, dtype=torch.bfloat16):
    e, k, h, i = shape["num_experts"], shape["top_k"], shape["hidden"], shape["inner"]
    x = torch.randn(num_tokens, h, device=device).to(dtype)
    ids = torch.rand(num_tokens, e, device=device).argsort(dim=1)[:, :k]
    weights = torch.rand(num_tokens, k, device=device).softmax(dim=1)
    return x, weights, ids


def random_experts(shape: dict, device: torch.device, dtype=torch.bfloat16) -> ExpertWeights:
    e, h, i = shape["num_experts"], shape["hidden"], shape["inner"]
    gate_up = (torch.randn(e, 2 * i, h, device=device) * h**-0.5).to(dtype)
    down = (torch.randn(e, h, i, device=device) * i**-0.5).to(dtype)
    return ExpertWeights(gate_up, down, swiglu_limit=shape["swiglu_limit"])


def measure(shape: dict, w: ExpertWeights, num_tokens: int, device: torch.device, repeats: int) -> list[dict]:
    x, weights, ids = random_case(shape, num_tokens, device)
    h, i, k = shape["hidden"], shape["inner"], shape["top_k"]
    flops = 6 * num_tokens * k * h * i
    weight_bytes = ids.unique().numel() * 3 * h * i * w.gate_up.element_size()
    reference = NativeMoE(None).experts(x, weights, ids, w).float()
    rows = []
    for method, fn in METHODS.items():
        row = {"tokens": num_tokens, "method": method}
        try:
            out = fn(x, weights, ids, w)
            ms = time_ms(lambda: fn(x, weights, ids, w), device, repeats=repeats)
        except (RuntimeError, NotImplementedError, AttributeError) as e:  # e.g. _grouped_mm missing or refusing
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        else:
            row.update(ms=round(ms, 4), tflops=round(flops / ms / 1e9, 2),
                       rel_err_vs_native=float((out.float() - reference).norm() / reference.norm()))
            if device.type == "cuda" and method in CAPTURABLE:
                try:
                    graph_ms = time_ms(graphed(lambda: fn(x, weights, ids, w), device), device, repeats=repeats)
                except RuntimeError as e:
                    row["graph_error"] = f"{type(e).__name__}: {e}"[:300]
                else:
                    row.update(graph_ms=round(graph_ms, 4), graph_tflops=round(flops / graph_ms / 1e9, 2),
                               graph_weight_gbps=round(weight_bytes / graph_ms / 1e6, 1))
        rows.append(row)
    fused = rows[0]
    for row in rows:
        for key in ("ms", "graph_ms"):
            if key in row and key in fused:
                row[f"{key}_over_fused"] = round(row[key] / fused[key], 3)
    return rows


def run(device, shapes: dict | None = None, tokens=TOKENS, repeats: int = 20) -> dict:
    """Every method at every shape and token count on ``device``: a dict ready for JSON."""
    import triton

    device = torch.device(device)
    shapes = SHAPES if shapes is None else shapes
    result = {
        "benchmark": "moe_experts",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "triton": triton.__version__, "dtype": "bfloat16",
        "grouped_mm": "torch._grouped_mm" if hasattr(torch, "_grouped_mm") else "unavailable in this torch",
        "shapes": {},
    }
    for name, shape in shapes.items():
        w = random_experts(shape, device)
        result["shapes"][name] = {**shape, "results": [row for t in tokens
                                                       for row in measure(shape, w, t, device, repeats)]}
        del w
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return result


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    result = {**run(args.device, repeats=args.repeats), "commit": _commit()}
    for name, shape in result["shapes"].items():
        for row in shape["results"]:
            cells = f"{row['ms']:9.4f} ms {row['tflops']:8.2f} TFLOP/s" if "ms" in row else row["error"]
            if "graph_ms" in row:
                cells += f" | graph {row['graph_ms']:9.4f} ms {row['graph_tflops']:8.2f} TFLOP/s"
            print(f"{name:18s} T={row['tokens']:5d} {row['method']:17s} {cells}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
