"""What every device benchmark shares: timing, the device's measured ceilings, and result files.

Ceilings are measured in the same run as the kernels they judge: a large device-to-device copy
(bytes read plus written) for bandwidth, large random bf16 and FP8 matrix products for the
matrix rates. Times are medians of ``triton.testing.do_bench`` (CUDA events, L2 flushed).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from pathlib import Path

import torch


def commit() -> str:
    """$ENGINE_COMMIT where set (a device copy's git metadata can be stale), else git's HEAD."""
    if os.environ.get("ENGINE_COMMIT"):
        return os.environ["ENGINE_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def sync() -> None:
    """Waits for the device where there is one (end-to-end helpers also run on the CPU in tests/core)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn) -> float:
    """Seconds of one call of ``fn``, the device synchronised before and after."""
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def bench_ms(fn, warmup: int = 25, rep: int = 100) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def graph_ms(calls: list, replays: int = 20) -> float:
    """Device time per call of ``calls`` captured back to back in one CUDA graph, as a decode step's
    kernels run: no host launch gaps, which dominate ``bench_ms`` for microsecond kernels. Calls
    should read distinct buffers (more than the L2 holds in all) so that none reads from the L2."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:  # compiles and warms outside the capture
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays / len(calls)


def device_kernels(fn, runs: int = 1, top: int | None = 40) -> dict:
    """The device kernels ``fn`` launches (graph replays included), by name: how many a run and
    their device ms a run, the largest first (torch.profiler's CUDA activity)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            fn()
        torch.cuda.synchronize()
    kernels = sorted(((e.key, e.count / runs, e.self_device_time_total / runs / 1e3)
                      for e in prof.key_averages() if e.device_type == DeviceType.CUDA), key=lambda k: -k[2])
    return {"per_run": round(sum(k[1] for k in kernels), 1),
            "device_ms_per_run": round(sum(k[2] for k in kernels), 4),
            "top": [{"kernel": name[:90], "per_run": round(n, 1), "ms_per_run": round(ms, 4)}
                    for name, n, ms in kernels[:top]]}


def kernels_beyond(longer: dict, shorter: dict, n: int) -> dict:
    """Per unit of what ``longer`` ran n more of than ``shorter`` (two ``device_kernels`` with
    top=None): each kernel's launches and ms beyond, the largest first."""
    base = {k["kernel"]: k for k in shorter["top"]}
    rows = [(k["kernel"], (k["per_run"] - base.get(k["kernel"], {}).get("per_run", 0)) / n,
             (k["ms_per_run"] - base.get(k["kernel"], {}).get("ms_per_run", 0)) / n) for k in longer["top"]]
    rows = sorted((r for r in rows if r[1] > 0 or r[2] > 0), key=lambda r: -r[2])
    return {"per_run": round(sum(r[1] for r in rows), 1), "device_ms_per_run": round(sum(r[2] for r in rows), 4),
            "top": [{"kernel": name, "per_run": round(c, 1), "ms_per_run": round(ms, 4)} for name, c, ms in rows]}


def device_info(device: torch.device) -> dict:
    p = torch.cuda.get_device_properties(device)
    return {"name": p.name, "sm": f"{p.major}{p.minor}", "sm_count": p.multi_processor_count,
            "memory_gib": round(p.total_memory / 2**30, 1), "torch": torch.__version__,
            "triton": __import__("triton").__version__, "host": platform.node()}


def measure_limits(device: torch.device) -> dict:
    """Copy bandwidth (GB/s) and bf16 / FP8 (per-tensor ``_scaled_mm``) matrix rates (TFLOP/s)."""
    src = torch.randn(2**30 // 2, dtype=torch.bfloat16, device=device)  # 1 GiB, far past the L2
    dst = torch.empty_like(src)
    copy_ms = bench_ms(lambda: dst.copy_(src))
    n = 8192
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    bf16_ms = bench_ms(lambda: a @ b)
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()
    one = torch.ones((), device=device)
    fp8_ms = bench_ms(lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16))
    flops = 2 * n**3
    return {"copy_gb_s": round(2 * src.numel() * 2 / copy_ms / 1e6, 1),
            "bf16_tflop_s": round(flops / bf16_ms / 1e9, 1), "fp8_tflop_s": round(flops / fp8_ms / 1e9, 1)}


def write_result(path: str | Path, result: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=2) + "\n")


def bench_main(run, lines) -> None:
    """The command line of a device benchmark: run on the GPU, print ``lines(result)``, write --json."""
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--json", default=None)
    args = p.parse_args()
    device = torch.device("cuda")
    result = {"device": device_info(device), "commit": commit(), **run(device)}
    for line in lines(result):
        print(line)
    if args.json:
        write_result(args.json, result)
