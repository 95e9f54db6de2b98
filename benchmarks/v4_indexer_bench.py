"""The Triton lightning indexer (scores over the paged index keys + the stable top-k) at the
DeepSeek-V4-Flash shape (64 heads x 128, rope 64, top-512, rate 4), bf16 and E4M3 keys in pages of
64 tokens, beside the native torch composition it replaces (NativeV4Attention.select: per
sequence, a matmul, ReLU, the weighted head sum, a stable sort).

Decode at batch 1, 32 and 128 at 1K and 16K context, and a 4K-token prefill from 0. A step must
read each sequence's visible keys once (and their scales), the queries and weights, and write the
picks: that over the copy bandwidth measured in the same run is its bandwidth limit; its products
(tokens x visible entries x heads x 128 x 2) over the bf16 matrix rate are its compute limit; the
larger is the step's limit. ``max_entries`` is the engine's bound for a 32K-token context (the
scores' scratch and the grid are sized by it, as in a captured graph). The Triton times are device
times inside a CUDA graph, each call on its own cache and inputs (more than the L2 holds in all);
the native ones are eager (it reads the batch's host lists), host launches included, as it runs.

    python benchmarks/v4_indexer_bench.py --json benchmarks/results/v4-indexer-h200.json
"""

from __future__ import annotations

import random

import torch

from engine.backends.triton.v4_indexer import index_topk
from engine.core.families.v4_attention import Compression, IndexerLayer, V4AttentionLayer
from engine.core.forward import ForwardBatch
from engine.core.kv.storage import KVCache, KVLayerSpec
from engine.core.models.deepseek_v4.cache import flat
from engine.core.native.indexer import quantize_keys
from engine.core.native.rope import RotaryEmbedding
from engine.core.native.v4_attention import NativeV4Attention

try:
    from common import bench_main, bench_ms, graph_ms, measure_limits
except ImportError:
    from benchmarks.common import bench_main, bench_ms, graph_ms, measure_limits

HEADS, HEAD_DIM, ROPE_DIM, TOP_K, RATE, PAGE_SIZE = 64, 128, 64, 512, 4, 64
MAX_MODEL_LEN = 32768
DTYPE, FP8 = torch.bfloat16, torch.float8_e4m3fn
COPIES_BYTES = 256 * 2**20


def _lens(step: str, context: int) -> list[tuple[int, int]]:
    """(cached, new) per sequence."""
    if step == "prefill-4096":
        return [(0, 4096)]
    return [(random.randint(context // 2, context - 1), 1) for _ in range(int(step.split("-")[1]))]


class Step:
    """One step's index-key cache (every slot filled), batch, queries and weights."""

    def __init__(self, lens, fp8: bool, device) -> None:
        need = [-(-(c + q) // PAGE_SIZE) for c, q in lens]
        pages = random.sample(range(1, sum(need) + 1), sum(need))
        tables = [pages[sum(need[:i]):sum(need[:i + 1])] for i in range(len(lens))]
        self.kv = KVCache([KVLayerSpec(1, HEAD_DIM, 0, RATE)], sum(need) + 1, PAGE_SIZE, DTYPE, device)
        keys = flat(self.kv, 0)[0]
        keys.normal_()
        self.keys, self.scales = quantize_keys(keys) if fp8 else (keys, None)
        new = [q for _, q in lens]
        self.batch = ForwardBatch.build(input_ids=[0] * sum(new), query_lens=new, context_lens=[c for c, _ in lens],
                                        page_tables=tables, page_size=PAGE_SIZE, logits_indices=[], device=device)
        self.token_seq = torch.arange(len(lens), dtype=torch.int32, device=device).repeat_interleave(
            torch.tensor(new, device=device))
        self.q = torch.randn(sum(new), HEADS, HEAD_DIM, device=device, dtype=DTYPE)
        self.weights = torch.randn(sum(new), HEADS, device=device, dtype=DTYPE)  # as the projection gives them


def _limits(lens, fp8: bool, limits: dict) -> tuple[float, float, float]:
    """(bytes, FLOPs, the step's limit in ms)."""
    key_bytes = HEAD_DIM * (1 if fp8 else DTYPE.itemsize) + (4 if fp8 else 0)
    tokens = sum(q for _, q in lens)
    nbytes = sum((c + q) // RATE for c, q in lens) * key_bytes + tokens * (HEADS * HEAD_DIM * 2 + HEADS * 2 + TOP_K * 4)
    flops = sum(2 * HEADS * HEAD_DIM * ((p + 1) // RATE) for c, q in lens for p in range(c, c + q))
    return nbytes, flops, max(nbytes / (limits["copy_gb_s"] * 1e6), flops / (limits["bf16_tflop_s"] * 1e9))


def _case(step: str, context: int, fp8: bool, device, limits: dict, rope: RotaryEmbedding) -> dict:
    lens = _lens(step, context)
    nbytes, flops, ideal = _limits(lens, fp8, limits)
    copies = max(1, min(16, COPIES_BYTES // nbytes))
    steps = [Step(lens, fp8, device) for _ in range(copies)]
    max_entries = -(-MAX_MODEL_LEN // RATE)

    def call(s: Step):
        return index_topk(s.q, s.weights, s.keys, s.scales, rope.cos, rope.sin, s.batch.positions, s.token_seq,
                          s.batch.page_table, PAGE_SIZE, RATE, TOP_K, max_entries, weight_scale=HEADS ** -0.5)

    fast = graph_ms([lambda s=s: call(s) for s in steps])
    s = steps[0]
    comp = Compression(RATE, True, torch.zeros(RATE, 2 * HEAD_DIM, device=device), torch.ones(HEAD_DIM, device=device),
                       1e-6, 0, 0)
    layer = V4AttentionLayer(HEADS, HEAD_DIM, 128, torch.zeros(HEADS, device=device), rope, 0,
                             torch.ones(HEAD_DIM, device=device), 1e-6,
                             indexer=IndexerLayer(HEADS, HEAD_DIM, TOP_K, comp))
    native = NativeV4Attention(None)
    meta = native.prepare(s.batch, s.kv)  # bf16 keys: the native path has no FP8 keys
    slow = bench_ms(lambda: native.select(s.q, s.weights, layer, s.kv, s.batch, meta), warmup=3, rep=20)
    return {"step": step, "context": context if step != "prefill-4096" else 4096, "keys": "fp8" if fp8 else "bf16",
            "tokens": sum(q for _, q in lens), "mb": round(nbytes / 1e6, 3), "gflop": round(flops / 1e9, 3),
            "triton_ms": round(fast, 4), "native_bf16_ms": round(slow, 4), "triton_of_limit": round(ideal / fast, 3),
            "triton_of_bandwidth": round(nbytes / (limits["copy_gb_s"] * 1e6) / fast, 3),
            "speedup": round(slow / fast, 1)}


STEPS = [(f"decode-{b}", c) for c in (1024, 16384) for b in (1, 32, 128)] + [("prefill-4096", 4096)]


def indexer_bench(device: torch.device, limits: dict) -> dict:
    """Every step in bf16 and FP8 keys: Triton and native times and fractions of the step's limit."""
    random.seed(torch.seed() % 2**31)
    rope = RotaryEmbedding(HEAD_DIM, ROPE_DIM, MAX_MODEL_LEN, 160000.0, None, is_neox_style=False, device=device)
    return {"shape": dict(heads=HEADS, head_dim=HEAD_DIM, rope_dim=ROPE_DIM, top_k=TOP_K, rate=RATE,
                          page_size=PAGE_SIZE, max_model_len=MAX_MODEL_LEN),
            "cases": [_case(step, context, fp8, device, limits, rope) for step, context in STEPS
                      for fp8 in (False, True)]}


def run(device: torch.device) -> dict:
    limits = measure_limits(device)
    return {"benchmark": "v4_indexer", "limits": limits, **indexer_bench(device, limits)}


def _lines(result: dict) -> list[str]:
    lim = result["limits"]
    out = [f"copy bandwidth {lim['copy_gb_s']} GB/s, bf16 {lim['bf16_tflop_s']} TFLOP/s"]
    for r in result["cases"]:
        out.append(f"{r['step']:12s} ctx {r['context']:5d} {r['keys']:4s} T {r['tokens']:5d} {r['mb']:8.3f} MB "
                   f"{r['gflop']:8.3f} GFLOP: triton {r['triton_ms']:.4f} ms ({r['triton_of_limit']:.2f} of limit, "
                   f"{r['triton_of_bandwidth']:.2f} of bandwidth), native {r['native_bf16_ms']:.3f} ms, {r['speedup']}x")
    return out


if __name__ == "__main__":
    bench_main(run, _lines)
