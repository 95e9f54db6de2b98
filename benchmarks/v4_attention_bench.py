"""The Triton V4 window store and sparse attention at the DeepSeek-V4-Flash layer shape (64 heads of
512, one K=V head, rope 64, window 128; CSA rate 4 picking 512; HCA rate 128), bf16 pages of 64
tokens, beside the native torch composition they replace (NativeV4Attention.store and .attend:
per sequence, gathered keys, SDPA-like fp32 attention, the norms and rotations as torch ops).

Decode at batch 1, 32 and 128 at 1K and 16K context, and a 4K-token prefill from 0. A step's
limit is the larger of its bytes over the copy bandwidth (each sequence's window keys and entries
read once, q read and the output written, the window row stored) and its products (tokens x keys x
heads x 512 x 2, scores and weighted sum) over the bf16 matrix rate, both measured in the same
run. The Triton times are device times inside a CUDA graph (store + attend, as a layer runs them),
each call on its own cache and inputs (more than the L2 holds in all); the native ones are eager
(it reads the batch's host lists), host launches included, as it runs.

    python benchmarks/v4_attention_bench.py --json benchmarks/results/v4-attention-h200.json
"""

from __future__ import annotations

import random

import torch

from engine.backends.triton.v4_attention import TritonV4Attention
from engine.core.families.v4_attention import Compression, IndexerLayer, V4AttentionLayer
from engine.core.forward import ForwardBatch
from engine.core.kv.storage import KVCache
from engine.core.models.deepseek_v4.cache import cache_layout, flat
from engine.core.native.rope import RotaryEmbedding
from engine.core.native.v4_attention import NativeV4Attention

try:
    from common import bench_main, bench_ms, graph_ms, measure_limits
except ImportError:
    from benchmarks.common import bench_main, bench_ms, graph_ms, measure_limits

HEADS, HEAD_DIM, ROPE_DIM, WINDOW, TOP_K = 64, 512, 64, 128, 512
RATES = {"sliding": 0, "csa": 4, "hca": 128}
PAGE_SIZE, DTYPE, MAX_POSITION = 64, torch.bfloat16, 20000
COPIES_BYTES = 512 * 2**20
STEPS = ("decode-1-1024", "decode-32-1024", "decode-128-1024", "decode-1-16384", "decode-32-16384",
         "decode-128-16384", "prefill-4096")


def _lens(step: str) -> list[tuple[int, int]]:
    """(cached, new) per sequence: decode rows at about the context length, or one prompt from 0."""
    if step.startswith("prefill"):
        return [(0, int(step.split("-")[1]))]
    _, batch, context = step.split("-")
    return [(random.randint(int(context) * 3 // 4, int(context)), 1) for _ in range(int(batch))]


def _layer(kind: str, cache, device) -> V4AttentionLayer:
    rope = RotaryEmbedding(HEAD_DIM, ROPE_DIM, MAX_POSITION, 10000.0, None, is_neox_style=False, device=device)
    rate, comp, index = RATES[kind], None, None
    if rate:
        width = 2 * HEAD_DIM if kind == "csa" else HEAD_DIM
        comp = Compression(rate, kind == "csa", torch.zeros(rate, width, device=device),
                           torch.ones(HEAD_DIM, device=device), 1e-6, cache.projections, cache.entries)
    if kind == "csa":
        index = IndexerLayer(64, 128, TOP_K, comp)  # attend reads top_k only
    kv_norm = 1 + 0.1 * torch.randn(HEAD_DIM, device=device)
    return V4AttentionLayer(HEADS, HEAD_DIM, WINDOW, torch.randn(HEADS, device=device), rope, cache.window, kv_norm,
                            1e-6, comp, index)


class Step:
    """One layer's cache (window pages only where the window reaches), a step's batch, q, the new
    window rows and (CSA) the picks: random visible entries, -1 past what a row sees."""

    def __init__(self, kind: str, lens, device) -> None:
        rate = RATES[kind]
        specs, (cache,) = cache_layout(HEAD_DIM, [rate], [kind == "csa"], 128)
        need = [-(-(c + n) // PAGE_SIZE) for c, n in lens]
        reach = [list(range(max(0, c + 1 - WINDOW) // PAGE_SIZE, k)) for (c, _), k in zip(lens, need)]
        self.kv = KVCache(specs, sum(need) + 1, PAGE_SIZE, DTYPE, device,
                          num_window_pages=sum(map(len, reach)) + 1)
        pages = random.sample(range(1, sum(need) + 1), sum(need))
        tables = [pages[sum(need[:i]):sum(need[:i + 1])] for i in range(len(lens))]
        windows = iter(random.sample(range(1, sum(map(len, reach)) + 1), sum(map(len, reach))))
        for table, near in zip(tables, reach):
            for i in near:
                self.kv.stage_window(table[i], next(windows))
        for i in range(self.kv.num_layers):
            self.kv.layer(i).k.normal_()
        new = [n for _, n in lens]
        self.batch = ForwardBatch.build([0] * sum(new), new, [c for c, _ in lens], tables, PAGE_SIZE, [],
                                        device=device)
        self.layer = _layer(kind, cache, device)
        self.q = torch.randn(sum(new), HEADS, HEAD_DIM, device=device, dtype=DTYPE)
        self.kv_new = torch.randn(sum(new), HEAD_DIM, device=device, dtype=DTYPE)
        self.picks = None
        if kind == "csa":
            visible = (self.batch.positions + 1) // rate
            scores = torch.rand(sum(new), int(visible.max()), device=device)
            scores[torch.arange(scores.shape[1], device=device) >= visible[:, None]] = -1
            top = scores.topk(min(TOP_K, scores.shape[1]), dim=1)
            self.picks = torch.full((sum(new), TOP_K), -1, dtype=torch.int32, device=device)
            self.picks[:, :top.indices.shape[1]] = torch.where(top.values >= 0, top.indices, -1).int()

    def run(self, backend, meta=None):
        meta = meta if meta is not None else backend.prepare(self.batch, self.kv)
        backend.store(self.kv_new, self.layer, self.kv, self.batch, meta)
        return backend.attend(self.q, self.layer, self.kv, self.batch, meta, self.picks)


def _work(kind: str, lens) -> tuple[int, int]:
    """Bytes a step must move and the products it must do."""
    rate, es, row = RATES[kind], DTYPE.itemsize, HEAD_DIM * DTYPE.itemsize
    keys_read, products = 0, 0
    for c, n in lens:
        end = c + n
        entries = 0 if not rate else min(TOP_K * n, end // rate) if kind == "csa" else end // rate
        keys_read += min(end, WINDOW + n - 1) + entries  # each sequence's keys once
        for p in range(c, end):
            seen = 0 if not rate else (p + 1) // rate
            keys = min(p + 1, WINDOW) + (min(TOP_K, seen) if kind == "csa" else seen)
            products += 2 * 2 * HEADS * HEAD_DIM * keys
    tokens = sum(n for _, n in lens)
    return keys_read * row + tokens * (2 * HEADS * HEAD_DIM * es + 2 * row), products


def _case(kind: str, step: str, device, limits: dict) -> dict:
    lens = _lens(step)
    nbytes, products = _work(kind, lens)
    copies = max(1, min(8, COPIES_BYTES // max(1, nbytes)))
    steps = [Step(kind, lens, device) for _ in range(copies)]
    fast_backend = TritonV4Attention(None)
    fast = graph_ms([lambda s=s: s.run(fast_backend) for s in steps])
    native, s = NativeV4Attention(None), steps[0]
    meta = native.prepare(s.batch, s.kv)
    slow = bench_ms(lambda: s.run(native, meta))
    limit = max(nbytes / (limits["copy_gb_s"] * 1e6), products / (limits["bf16_tflop_s"] * 1e9))
    return {"layer": kind, "step": step, "tokens": sum(n for _, n in lens), "mb": round(nbytes / 1e6, 3),
            "gflop": round(products / 1e9, 3), "triton_ms": round(fast, 4), "native_ms": round(slow, 4),
            "limit_ms": round(limit, 4), "triton_of_limit": round(limit / fast, 3),
            "native_of_limit": round(limit / slow, 4), "speedup": round(slow / fast, 1)}


def attention_bench(device: torch.device, limits: dict) -> dict:
    """Store + attend for every layer kind at every step: Triton and native times, fractions of the limit."""
    random.seed(torch.seed() % 2**31)
    return {"shape": dict(heads=HEADS, head_dim=HEAD_DIM, rope_dim=ROPE_DIM, window=WINDOW, top_k=TOP_K,
                          rates=RATES), "page_size": PAGE_SIZE, "dtype": str(DTYPE),
            "cases": [_case(kind, step, device, limits) for kind in RATES for step in STEPS]}


def run(device: torch.device) -> dict:
    limits = measure_limits(device)
    return {"benchmark": "v4_attention", "limits": limits, **attention_bench(device, limits)}


def _lines(result: dict) -> list[str]:
    lim = result["limits"]
    out = [f"copy bandwidth {lim['copy_gb_s']} GB/s, bf16 {lim['bf16_tflop_s']} TFLOP/s"]
    for r in result["cases"]:
        out.append(f"{r['layer']:7s} {r['step']:17s} T {r['tokens']:5d} {r['mb']:9.3f} MB {r['gflop']:8.3f} GFLOP: "
                   f"triton {r['triton_ms']:.4f} ms ({r['triton_of_limit']:.2f} of limit), "
                   f"native {r['native_ms']:.3f} ms, {r['speedup']}x")
    return out


if __name__ == "__main__":
    bench_main(run, _lines)
