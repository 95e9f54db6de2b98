"""The Triton mHC kernels (pre, post, head, and a sublayer boundary) at the DeepSeek-V4-Flash shape
(n 4 streams of hidden 4096) beside the native torch composition they replace (core/native/mhc.py),
at 1, 32 and 128 decode tokens and a 4K prefill, bf16 streams and fp32 mixing weights. Each is
judged against the bytes it must move over the copy bandwidth measured in the same run: pre and
head read the streams and their fn once and write the collapse; post reads block_out and the
streams and writes the new streams; the boundary (post, the next pre, the RMSNorm of its collapse:
what the model runs between two sublayers) does both, the collapse reading the new streams again.
The boundary (one launch) is also timed as two (the post writing the pre's partials, then the
per-token kernel: the figure before it was one launch) and as the unfused launches one after
another (post, pre's two, the norm kernel), the figure before post wrote the pre's partials. Times
are device times inside a CUDA graph, each call on its own copy of the inputs (more than the L2
holds in all), as a decode step's layers read distinct weights.

    python benchmarks/v4_mhc_bench.py --json benchmarks/results/v4-mhc-h200.json
"""

from __future__ import annotations

import torch

from engine.backends.triton.mhc import mhc_head, mhc_post, mhc_post_pre, mhc_pre, two_launch_boundary, two_launch_pre
from engine.backends.triton.norm import rms_norm
from engine.core.families.mhc import MixWeights
from engine.core.native.mhc import NativeMHC, hc_head, hc_post, hc_pre
from engine.core.native.norm import NativeNorm

try:
    from common import bench_main, graph_ms, measure_limits
except ImportError:
    from benchmarks.common import bench_main, graph_ms, measure_limits

N, D = 4, 4096
TOKENS = (1, 32, 128, 4096)
COPIES_BYTES = 192 * 2**20  # inputs per case: several times the L2
ITERS = 20  # V4-Flash's Sinkhorn-Knopp iterations


def _case(t: int, device, gen, copy_gb_s: float) -> dict:
    k, es = N * D, 2
    copies = max(1, min(32, COPIES_BYTES // (t * k * es + (2 + N) * N * k * 4)))

    def weights(mixes, scales):
        return MixWeights(torch.randn(mixes, k, device=device, generator=gen) / k**0.5,
                          torch.randn(mixes, device=device, generator=gen),
                          torch.randn(scales, device=device, generator=gen), 1e-6, 1e-6, ITERS)

    inputs = []
    for _ in range(copies):
        streams = torch.randn(t, N, D, device=device, generator=gen).to(torch.bfloat16)
        block_out = torch.randn(t, D, device=device, generator=gen).to(torch.bfloat16)
        w, head = weights((2 + N) * N, 3), weights(N, 1)
        _, post, comb = hc_pre(streams, w.fn, w.base, w.scale, 1e-6, 1e-6, ITERS)
        inputs.append((streams, block_out, w, head, post, comb))
    g, ops = torch.ones(D, device=device), NativeNorm(None)

    def unfused(s, b, w, post, comb):
        new = mhc_post(b, s, post, comb)
        x, post, comb = two_launch_pre(new, w)
        return new, rms_norm(x, g, 1e-6), post, comb

    calls = {
        "pre": (lambda s, b, w, h, p, c: mhc_pre(s, w),
                lambda s, b, w, h, p, c: hc_pre(s, w.fn, w.base, w.scale, 1e-6, 1e-6, ITERS),
                t * k * es + (2 + N) * N * k * 4 + t * D * es),
        "post": (lambda s, b, w, h, p, c: mhc_post(b, s, p, c), lambda s, b, w, h, p, c: hc_post(b, s, p, c),
                 t * D * es + 2 * t * k * es),
        "head": (lambda s, b, w, h, p, c: mhc_head(s, h),
                 lambda s, b, w, h, p, c: hc_head(s, h.fn, h.base, h.scale, 1e-6, 1e-6),
                 t * k * es + N * k * 4 + t * D * es),
        "boundary": (lambda s, b, w, h, p, c: mhc_post_pre(b, s, p, c, w, (g, 1e-6)),
                     lambda s, b, w, h, p, c: NativeMHC(None).post_pre_norm(b, s, p, c, w, g, 1e-6, ops),
                     2 * t * D * es + 3 * t * k * es + (2 + N) * N * k * 4),
    }
    row = {"tokens": t}
    for name, (triton_call, native_call, nbytes) in calls.items():
        ideal = nbytes / (copy_gb_s * 1e6)
        fast = graph_ms([lambda a=a: triton_call(*a) for a in inputs])
        slow = graph_ms([lambda a=a: native_call(*a) for a in inputs])
        row[name] = {"triton_ms": round(fast, 4), "native_ms": round(slow, 4), "mb": round(nbytes / 1e6, 2),
                     "triton_of_bandwidth": round(ideal / fast, 3), "native_of_bandwidth": round(ideal / slow, 3),
                     "speedup": round(slow / fast, 2)}
    apart = graph_ms([lambda a=a: unfused(a[0], a[1], a[2], a[4], a[5]) for a in inputs])
    two = graph_ms([lambda a=a: two_launch_boundary(a[1], a[0], a[4], a[5], a[2], (g, 1e-6)) for a in inputs])
    fused = row["boundary"]["triton_ms"]
    row["boundary"].update(unfused_ms=round(apart, 4), fused_over_unfused=round(apart / fused, 2),
                           two_launch_ms=round(two, 4), one_over_two_launches=round(two / fused, 2))
    return row


def mhc_bench(device: torch.device, limits: dict) -> dict:
    """pre, post and head at every token count: Triton and native times and fractions of the copy bandwidth."""
    gen = torch.Generator(device=device)
    gen.manual_seed(torch.seed() % 2**31)
    return {"shape": {"n": N, "hidden": D, "sinkhorn_iters": ITERS, "streams": "bfloat16"},
            "cases": [_case(t, device, gen, limits["copy_gb_s"]) for t in TOKENS]}


def run(device: torch.device) -> dict:
    limits = measure_limits(device)
    return {"benchmark": "v4_mhc", "limits": limits, **mhc_bench(device, limits)}


def _lines(result: dict) -> list[str]:
    out = [f"copy bandwidth {result['limits']['copy_gb_s']} GB/s"]
    for case in result["cases"]:
        for name in ("pre", "post", "head", "boundary"):
            r = case[name]
            out.append(f"T {case['tokens']:5d} {name:8s}: triton {r['triton_ms']:.4f} ms "
                       f"({r['triton_of_bandwidth']:.2f} of bandwidth), native {r['native_ms']:.4f} ms "
                       f"({r['native_of_bandwidth']:.2f}), {r['speedup']}x")
        r = case["boundary"]
        out.append(f"T {case['tokens']:5d} boundary unfused (4 launches): {r['unfused_ms']:.4f} ms, "
                   f"fused {r['fused_over_unfused']}x faster; two launches {r['two_launch_ms']:.4f} ms, "
                   f"one launch {r['one_over_two_launches']}x faster")
    return out


if __name__ == "__main__":
    bench_main(run, _lines)
