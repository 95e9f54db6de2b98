"""Fused MoE experts (Triton) against ``torch._grouped_mm`` and a per-expert loop.

Expert compute only (routing excluded), bf16, at Qwen3-30B-A3B and DeepSeek-V4-Flash expert shapes,
1 to 4096 tokens with uniform random routing. Each method is timed end to end as a user would
call it (sorting by expert, both GEMMs, SwiGLU, the weighted top-k sum) with CUDA events: warm-up,
then the median of repeats; the methods with no host sync are also timed replayed from a CUDA
graph, as a captured step runs them. TFLOP/s counts 6 * T * top_k * H * I (gate/up and down);
GB/s counts the weights of the experts the routing touched, the bound at decode sizes.

Two more comparisons at the DeepSeek-V4-Flash shape, through the fused Triton experts:
- ``fp4``: the routed experts kept in DeepSeek-V4's FP4 (E2M1 + E8M0 per 32) against the same
  experts in bf16 (GB/s counts the packed bytes and scales);
- ``fold``: the shared expert folded into the routed launch (one more expert every token takes with
  weight 1, what ``core/models/deepseek_v4/moe.py`` does with ``FOLD_SHARED``) against a second
  launch for it. ``fold_over_separate`` below 1 at the token counts that matter says to turn
  ``FOLD_SHARED`` on;
- ``dispatch``: a decode step's layer after the router with its routing and alignment by expert in
  one launch (``TritonMoE.route_experts``, moe_dispatch.py) against the routing and the alignment
  launched apart (``route`` then ``experts``), the shared expert folded, at decode batch sizes:
  ``dispatch_over_apart`` above 1 at a batch says ``DISPATCH.tokens`` should stop below it;
- ``fp8_quantize``: FP8 experts with the activations quantized inside the two GEMMs (decode) against
  a quantization launch before each;
- ``one_launch``: a decode step's layer through ``TritonMoE.route_experts`` with each stack's experts
  in one launch (moe_one_launch.py: gate/up then down and the combine) against their two grouped
  GEMM launches, in bf16 (the shared expert folded), FP8 and FP4 (routed experts only):
  ``one_over_two`` below 1 says the one launch pays at that batch.

    python benchmarks/moe_bench.py [--json benchmarks/results/moe-<device>.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from engine.core.families.moe import ExpertWeights
from engine.core.native.moe import NativeMoE, _swiglu

try:
    from common import commit
except ImportError:
    from benchmarks.common import commit

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
    from engine.backends.triton.moe import TritonMoE

    return TritonMoE(None).experts(x, weights, ids, w)


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
    e, k, h = shape["num_experts"], shape["top_k"], shape["hidden"]
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


def fp4_experts(w: ExpertWeights) -> ExpertWeights:
    """``w`` in DeepSeek-V4's FP4 expert format, quantized one expert at a time to bound the fp32 copies."""
    from engine.core.native.quant import quantize_fp4

    def stack(t):
        data, scale = zip(*(quantize_fp4(m) for m in t))
        return torch.stack(data), torch.stack(scale)
    (gu, gu_scale), (dn, dn_scale) = stack(w.gate_up), stack(w.down)
    return ExpertWeights(gu, dn, w.activation, w.swiglu_limit, scheme="fp4", gate_up_scale=gu_scale, down_scale=dn_scale)


def graph_ms(fn, device: torch.device, repeats: int) -> float:
    return time_ms(graphed(fn, device), device, repeats=repeats)


def measure_fp4(shape: dict, w: ExpertWeights, w4: ExpertWeights, num_tokens: int, device, repeats: int) -> dict:
    x, weights, ids = random_case(shape, num_tokens, device)
    used = ids.unique().numel()
    per_expert = sum(t[0].numel() * t.element_size() for t in (w4.gate_up, w4.down, w4.gate_up_scale, w4.down_scale))
    bf16_ms = graph_ms(lambda: fused_experts(x, weights, ids, w), device, repeats)
    fp4_ms = graph_ms(lambda: fused_experts(x, weights, ids, w4), device, repeats)
    ref = NativeMoE(None).experts(x, weights, ids, w4).float()
    out = fused_experts(x, weights, ids, w4).float()
    return {"tokens": num_tokens, "bf16_graph_ms": round(bf16_ms, 4), "fp4_graph_ms": round(fp4_ms, 4),
            "fp4_over_bf16": round(fp4_ms / bf16_ms, 3), "fp4_weight_gbps": round(used * per_expert / fp4_ms / 1e6, 1),
            "fp4_rel_err_vs_native": float((out - ref).norm() / ref.norm())}


def measure_fold(shape: dict, stack: ExpertWeights, num_tokens: int, device, repeats: int) -> dict:
    """``stack`` holds the routed experts and, last, the shared one; the separate way reads views of it."""
    e = shape["num_experts"]
    x, weights, ids = random_case(shape, num_tokens, device)
    routed = ExpertWeights(stack.gate_up[:e], stack.down[:e], swiglu_limit=stack.swiglu_limit)
    shared = ExpertWeights(stack.gate_up[e:], stack.down[e:], swiglu_limit=stack.swiglu_limit)
    ones = torch.ones(num_tokens, 1, device=device)
    zeros = torch.zeros(num_tokens, 1, dtype=torch.long, device=device)
    folded_weights, folded_ids = torch.cat([weights, ones], dim=1), torch.cat([ids, zeros + e], dim=1)

    def separate():
        return fused_experts(x, weights, ids, routed) + fused_experts(x, ones, zeros, shared)

    def folded():
        return fused_experts(x, folded_weights, folded_ids, stack)

    sep_ms, fold_ms = graph_ms(separate, device, repeats), graph_ms(folded, device, repeats)
    a, b = separate().float(), folded().float()
    return {"tokens": num_tokens, "separate_graph_ms": round(sep_ms, 4), "folded_graph_ms": round(fold_ms, 4),
            "fold_over_separate": round(fold_ms / sep_ms, 3), "rel_diff": float((a - b).norm() / a.norm())}


DECODE_TOKENS = (1, 4, 8, 16, 32, 64, 128)
ONE_LAUNCH_TOKENS = (1, 4, 16, 64)  # what one dispatch program routes on a GPU (DISPATCH.tokens)


def v4_routing(shape: dict, device):
    from engine.core.families.moe import RoutingConfig

    e = shape["num_experts"]
    return RoutingConfig(num_experts=e, top_k=shape["top_k"], scoring="sqrtsoftplus", routed_scaling_factor=1.5,
                         correction_bias=torch.randn(e, device=device) * 0.1, weight_dtype=torch.bfloat16,
                         shared_expert=e)


def measure_dispatch(shape: dict, stack: ExpertWeights, num_tokens: int, device, repeats: int) -> dict:
    """``stack`` holds the routed experts and, last, the shared one (folded)."""
    from engine.backends.triton.moe import TritonMoE
    from engine.backends.triton.moe_dispatch import fits_one_program

    moe, cfg = TritonMoE(None), v4_routing(shape, device)
    x = torch.randn(num_tokens, shape["hidden"], device=device).to(torch.bfloat16)
    logits = torch.randn(num_tokens, shape["num_experts"], device=device) * 3

    def apart():
        return moe.experts(x, *moe.route(logits, cfg), stack)

    def dispatched():
        return moe.route_experts(x, logits, cfg, stack)

    apart_ms, dispatch_ms = graph_ms(apart, device, repeats), graph_ms(dispatched, device, repeats)
    return {"tokens": num_tokens, "one_launch": fits_one_program(num_tokens, cfg, x.device),
            "apart_graph_ms": round(apart_ms, 4), "dispatch_graph_ms": round(dispatch_ms, 4),
            "dispatch_over_apart": round(dispatch_ms / apart_ms, 3), "equal": torch.equal(apart(), dispatched())}


def measure_one_launch(shape: dict, stack: ExpertWeights, num_tokens: int, device, repeats: int,
                       shared: bool) -> dict:
    """``stack``: the routed experts and, with ``shared``, the shared one last (folded)."""
    import dataclasses

    from engine.backends.triton.moe import TritonMoE

    one, two = TritonMoE(None), TritonMoE(None)
    two.one_launch = False
    cfg = v4_routing(shape, device)
    cfg = cfg if shared else dataclasses.replace(cfg, shared_expert=None)
    x = torch.randn(num_tokens, shape["hidden"], device=device).to(torch.bfloat16)
    logits = torch.randn(num_tokens, shape["num_experts"], device=device) * 3
    one_ms = graph_ms(lambda: one.route_experts(x, logits, cfg, stack), device, repeats)
    two_ms = graph_ms(lambda: two.route_experts(x, logits, cfg, stack), device, repeats)
    return {"tokens": num_tokens, "scheme": stack.scheme, "one_launch_graph_ms": round(one_ms, 4),
            "two_launches_graph_ms": round(two_ms, 4), "one_over_two": round(one_ms / two_ms, 3),
            "equal": torch.equal(one.route_experts(x, logits, cfg, stack), two.route_experts(x, logits, cfg, stack))}


def measure_fp8_quantize(shape: dict, w8: ExpertWeights, num_tokens: int, device, repeats: int) -> dict:
    from engine.backends.triton.fused_moe import fused_moe

    x, weights, ids = random_case(shape, num_tokens, device)

    def run(in_gemm: bool):
        return fused_moe(x, weights, ids, w8.gate_up, w8.down, swiglu_limit=w8.swiglu_limit,
                         gate_up_scale=w8.gate_up_scale, down_scale=w8.down_scale, quantize_in_gemm=in_gemm)

    launches_ms = graph_ms(lambda: run(False), device, repeats)
    in_gemm_ms = graph_ms(lambda: run(True), device, repeats)
    return {"tokens": num_tokens, "quantize_launches_graph_ms": round(launches_ms, 4),
            "in_gemm_graph_ms": round(in_gemm_ms, 4), "in_gemm_over_launches": round(in_gemm_ms / launches_ms, 3),
            "equal": torch.equal(run(False), run(True))}


def fp8_experts(w: ExpertWeights) -> ExpertWeights:
    from engine.core.native.quant import quantize_fp8_block

    def stack(t):
        data, scale = zip(*(quantize_fp8_block(m.float()) for m in t))
        return torch.stack(data), torch.stack(scale)

    (gu, gu_scale), (dn, dn_scale) = stack(w.gate_up), stack(w.down)
    return ExpertWeights(gu, dn, swiglu_limit=w.swiglu_limit, scheme="fp8_block", gate_up_scale=gu_scale,
                         down_scale=dn_scale)


def run_v4(device, tokens=TOKENS, repeats: int = 20) -> dict:
    """The fp4, fold, dispatch, one_launch and fp8_quantize comparisons at the DeepSeek-V4-Flash shape."""
    device = torch.device(device)
    shape = SHAPES["deepseek-v4-flash"]
    stack = random_experts({**shape, "num_experts": shape["num_experts"] + 1}, device)
    result = {"fold": [measure_fold(shape, stack, t, device, repeats) for t in tokens],
              "dispatch": [measure_dispatch(shape, stack, t, device, repeats) for t in DECODE_TOKENS],
              "one_launch": [measure_one_launch(shape, stack, t, device, repeats, True) for t in ONE_LAUNCH_TOKENS]}
    w = ExpertWeights(stack.gate_up[:-1], stack.down[:-1], swiglu_limit=shape["swiglu_limit"])
    w4 = fp4_experts(w)
    result["fp4"] = [measure_fp4(shape, w, w4, t, device, repeats) for t in tokens]
    result["one_launch"] += [measure_one_launch(shape, w4, t, device, repeats, False) for t in ONE_LAUNCH_TOKENS]
    del w4, stack
    w8 = fp8_experts(w)
    result["fp8_quantize"] = [measure_fp8_quantize(shape, w8, t, device, repeats) for t in DECODE_TOKENS[:5]]
    result["one_launch"] += [measure_one_launch(shape, w8, t, device, repeats, False) for t in ONE_LAUNCH_TOKENS]
    return result


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    result = {**run(args.device, repeats=args.repeats), "commit": commit()}
    result["deepseek_v4_flash"] = run_v4(args.device, repeats=args.repeats)
    for part, rows in result["deepseek_v4_flash"].items():
        for row in rows:
            print(f"deepseek-v4-flash {part:4s} " + " ".join(f"{k}={v}" for k, v in row.items()))
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
