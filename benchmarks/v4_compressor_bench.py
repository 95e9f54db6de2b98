"""The Triton V4 compressor (store the projections, pool the windows that close) at the
DeepSeek-V4-Flash shapes (CSA: head dim 512, rate 4, overlapping windows; HCA: 512, rate 128; the
CSA indexer's compressor: 128, rate 4, overlapping), bf16 pages of 64 tokens, beside the native
torch composition it replaces (NativeV4Attention.compress: a store, then a per-sequence pooling).

Decode at batch 1, 32 and 128 in two steps: one where every row closes a window (the step that
emits entries; HCA pools 128 tokens a row) and one where none does (the store alone, the common
step); and a 4K-token prefill from 0. Each is judged against the bytes it must move over the copy
bandwidth measured in the same run: the step's projections read and written to the window pages,
the cached slots of the windows that close read, the entries written, ``ape`` read once. The
Triton times are device times inside a CUDA graph, each call on its own cache and inputs (more
than the L2 holds in all); the native ones are eager (it reads the batch's host lists), host
launches included, as it runs.

    python benchmarks/v4_compressor_bench.py --json benchmarks/results/v4-compressor-h200.json
"""

from __future__ import annotations

import random

import torch

from engine.backends.triton.v4_attention import TritonV4Attention
from engine.backends.triton.v4_compressor import compress
from engine.core.families.v4_attention import Compression, V4AttentionLayer
from engine.core.forward import ForwardBatch
from engine.core.kv.storage import KVCache, KVLayerSpec
from engine.core.native.rope import RotaryEmbedding
from engine.core.native.v4_attention import NativeV4Attention

try:
    from common import bench_main, bench_ms, graph_ms, measure_limits
except ImportError:
    from benchmarks.common import bench_main, bench_ms, graph_ms, measure_limits

SHAPES = {"csa": (512, 4, True), "hca": (512, 128, False), "indexer": (128, 4, True)}  # head dim, rate, overlap
PAGE_SIZE, ROPE_DIM, DTYPE = 64, 64, torch.bfloat16
COPIES_BYTES = 256 * 2**20


def _lens(rate: int, step: str) -> list[tuple[int, int]]:
    """(cached, new) per sequence."""
    if step == "prefill-4096":
        return [(0, 4096)]
    batch, kind = int(step.split("-")[1]), step.split("-")[0]
    windows = [random.randint(2, max(2, 1024 // rate)) for _ in range(batch)]
    return [(w * rate - 1 if kind == "closing" else w * rate, 1) for w in windows]


class Step:
    """One compressor's cache (every page with a window page) and one step's batch and projections."""

    def __init__(self, shape, lens, device) -> None:
        head_dim, rate, overlap = shape
        width = 2 * head_dim if overlap else head_dim
        need = [-(-(c + q) // PAGE_SIZE) for c, q in lens]
        pages = random.sample(range(1, sum(need) + 1), sum(need))
        tables = [pages[sum(need[:i]):sum(need[:i + 1])] for i in range(len(lens))]
        self.kv = KVCache([KVLayerSpec(1, width, width, windowed=True), KVLayerSpec(1, head_dim, 0, rate)],
                          sum(need) + 1, PAGE_SIZE, DTYPE, device, num_window_pages=sum(need) + 1)
        for page, window in zip(pages, random.sample(range(1, sum(need) + 1), sum(need))):
            self.kv.stage_window(page, window)
        for t in (self.kv.layer(0).k, self.kv.layer(0).v):
            t.normal_()
        new = [q for _, q in lens]
        self.batch = ForwardBatch.build(input_ids=[0] * sum(new), query_lens=new, context_lens=[c for c, _ in lens],
                                        page_tables=tables, page_size=PAGE_SIZE, logits_indices=[], device=device)
        self.meta = TritonV4Attention(None).prepare(self.batch, self.kv)
        self.kv_proj = torch.randn(sum(new), width, device=device, dtype=DTYPE)
        self.gate_proj = torch.randn(sum(new), width, device=device, dtype=DTYPE)


def _bytes(shape, lens) -> int:
    """What a step must move: projections in and out, cached slots of closing windows, entries, ape."""
    head_dim, rate, overlap = shape
    width = 2 * head_dim if overlap else head_dim
    es = DTYPE.itemsize
    total = sum(q for _, q in lens) * width * 2 * 2 * es + rate * width * 4
    for c, q in lens:
        for w in range(c // rate, (c + q) // rate):
            first = (w - overlap) * rate
            cached = max(0, min(c, (w + 1) * rate) - max(0, first))
            total += cached * head_dim * 2 * es + head_dim * es
    return total


def _case(name: str, step: str, device, copy_gb_s: float) -> dict:
    shape = SHAPES[name]
    head_dim, rate, overlap = shape
    lens = _lens(rate, step)
    width = 2 * head_dim if overlap else head_dim
    rope = RotaryEmbedding(head_dim, ROPE_DIM, 8192, 10000.0, None, is_neox_style=False, device=device)
    comp = Compression(rate, overlap, torch.randn(rate, width, device=device),
                       1 + 0.1 * torch.randn(head_dim, device=device), 1e-6, projections=0, entries=1)
    layer = V4AttentionLayer(1, head_dim, 128, torch.zeros(1, device=device), rope, 0,
                             torch.ones(head_dim, device=device), 1e-6, comp)
    nbytes = _bytes(shape, lens)
    copies = max(1, min(16, COPIES_BYTES // nbytes))
    steps = [Step(shape, lens, device) for _ in range(copies)]
    fast = graph_ms([lambda s=s: compress(s.kv_proj, s.gate_proj, comp, layer, s.kv, s.batch, s.meta) for s in steps])
    native, s = NativeV4Attention(None), steps[0]
    native_meta = native.prepare(s.batch, s.kv)
    slow = bench_ms(lambda: native.compress(s.kv_proj, s.gate_proj, comp, layer, s.kv, s.batch, native_meta))
    ideal = nbytes / (copy_gb_s * 1e6)
    return {"compressor": name, "step": step, "tokens": sum(q for _, q in lens),
            "entries": sum((c + q) // rate - c // rate for c, q in lens), "mb": round(nbytes / 1e6, 3),
            "triton_ms": round(fast, 4), "native_ms": round(slow, 4), "triton_of_bandwidth": round(ideal / fast, 3),
            "native_of_bandwidth": round(ideal / slow, 4), "speedup": round(slow / fast, 1)}


STEPS = ("closing-1", "closing-32", "closing-128", "open-1", "open-32", "open-128", "prefill-4096")


def compressor_bench(device: torch.device, limits: dict) -> dict:
    """Every compressor at every step: Triton and native times and fractions of the copy bandwidth."""
    random.seed(torch.seed() % 2**31)
    return {"shape": {name: dict(zip(("head_dim", "rate", "overlap"), s)) for name, s in SHAPES.items()},
            "page_size": PAGE_SIZE, "dtype": str(DTYPE),
            "cases": [_case(name, step, device, limits["copy_gb_s"]) for name in SHAPES for step in STEPS]}


def run(device: torch.device) -> dict:
    limits = measure_limits(device)
    return {"benchmark": "v4_compressor", "limits": limits, **compressor_bench(device, limits)}


def _lines(result: dict) -> list[str]:
    out = [f"copy bandwidth {result['limits']['copy_gb_s']} GB/s"]
    for r in result["cases"]:
        out.append(f"{r['compressor']:7s} {r['step']:12s} T {r['tokens']:5d} entries {r['entries']:4d} "
                   f"{r['mb']:8.3f} MB: triton {r['triton_ms']:.4f} ms ({r['triton_of_bandwidth']:.2f} of bandwidth), "
                   f"native {r['native_ms']:.3f} ms, {r['speedup']}x")
    return out


if __name__ == "__main__":
    bench_main(run, _lines)
