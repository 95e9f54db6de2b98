"""The decode attention tuning sweep on the device: split counts, then launch configs, at the
Llama-3.1-8B (32 heads over 8) and Qwen3-0.6B (16 over 8) layer shapes, batch 1 to 64, context 1K
and 4K. Times are device times inside a CUDA graph (as decode steps run), each call on its own
copy of the pages so that none is read from the L2, as a fraction of the copy bandwidth measured in
the same run; the table's own choice is timed first as the anchor.

    python benchmarks/decode_attention_sweep.py --json benchmarks/results/decode-attention-sweep-h200.json
"""

from __future__ import annotations

import itertools
import math
import time

import torch
from tqdm import tqdm

from engine.backends.triton.attention_decode import DECODE, DecodeConfig, decode_attention, num_splits_for
from engine.backends.triton.attention_prefill import pick_dim
from engine.core.families.attention import AttentionLayer, LayerKV

try:
    from common import bench_main, graph_ms, measure_limits
except ImportError:
    from benchmarks.common import bench_main, graph_ms, measure_limits

PAGE, HEAD_DIM = 16, 128
SHAPES = {"llama-8b": (32, 8), "qwen3-0.6b": (16, 8)}  # query heads, KV heads
CASES = [(b, c) for b in (1, 8, 32, 64) for c in (1024, 4096)]
SPLITS = (1, 2, 4, 8, 16, 32, 64)
CONFIGS = [DecodeConfig(n, 16, w, s) for n, w, s in itertools.product((32, 64, 128), (4, 8), (1, 2, 3))]
COPIES_BYTES = 256 * 2**20
BUDGET_S = 170


def _key(cfg: DecodeConfig, splits: int) -> str:
    return f"splits {splits} n {cfg.block_n} warps {cfg.num_warps} stages {cfg.num_stages}"


def _case(shape: str, batch: int, ctx: int, device, gen, copy_gb_s: float, deadline: float) -> dict:
    heads, kv_heads = SHAPES[shape]
    layer = AttentionLayer(0, heads, kv_heads, HEAD_DIM, 1 / math.sqrt(HEAD_DIM))
    per_seq = ctx // PAGE
    kv_bytes = 2 * batch * ctx * kv_heads * HEAD_DIM * 2
    copies = []
    for _ in range(max(1, min(48, COPIES_BYTES // kv_bytes))):
        k = torch.randn(batch * per_seq + 1, PAGE, kv_heads, HEAD_DIM, dtype=torch.bfloat16, device=device,
                        generator=gen)
        copies.append(LayerKV(k, torch.randn_like(k)))
    table = (torch.randperm(batch * per_seq, device=device, generator=gen) + 1).view(batch, per_seq).to(torch.int32)
    q = torch.randn(batch, heads, HEAD_DIM, dtype=torch.bfloat16, device=device, generator=gen)
    starts = torch.arange(batch + 1, dtype=torch.int32, device=device)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    outs = [torch.empty_like(q) for _ in copies]

    def timed(cfg: DecodeConfig | None, splits: int | None) -> float:
        calls = [lambda kv=kv, o=o: decode_attention(q, kv, layer, o, table, starts, lens, None, cfg, splits)
                 for kv, o in zip(copies, outs)]
        return graph_ms(calls)

    tuning = DECODE["sm_90"]
    table_cfg = pick_dim(tuning.per_dim, HEAD_DIM)
    table_splits = num_splits_for(tuning, batch, kv_heads)
    anchor = timed(None, None)
    times = {}
    for splits in SPLITS:
        times[_key(table_cfg, splits)] = timed(table_cfg, splits)
    best_splits = int(min(times, key=times.get).split()[1])
    for cfg in CONFIGS:
        if time.monotonic() > deadline:
            break
        try:
            times.setdefault(_key(cfg, best_splits), timed(cfg, best_splits))
        except Exception:  # noqa: BLE001 - a config the device cannot compile or run is skipped
            continue
    best = min(times, key=times.get)
    ideal_ms = kv_bytes / (copy_gb_s * 1e6)
    return {"shape": shape, "batch": batch, "context": ctx, "kv_mb": round(kv_bytes / 1e6, 1),
            "table": _key(table_cfg, table_splits), "table_ms": round(anchor, 4),
            "table_of_bandwidth": round(ideal_ms / anchor, 3), "best": best, "best_ms": round(times[best], 4),
            "best_of_bandwidth": round(ideal_ms / times[best], 3), "best_vs_table": round(anchor / times[best], 3),
            "ms": {c: round(t, 4) for c, t in times.items()}}


def run(device: torch.device) -> dict:
    limits = measure_limits(device)
    gen = torch.Generator(device=device)
    gen.manual_seed(torch.seed() % 2**31)
    deadline, cases, skipped = time.monotonic() + BUDGET_S, [], []
    for shape, (batch, ctx) in tqdm(list(itertools.product(SHAPES, CASES)), desc="decode attention sweep"):
        if time.monotonic() > deadline:
            skipped.append(f"{shape} batch {batch} context {ctx}: past the time budget")
            continue
        cases.append(_case(shape, batch, ctx, device, gen, limits["copy_gb_s"], deadline))
        torch.cuda.empty_cache()
    return {"benchmark": "decode_attention_sweep", "limits": limits, "cases": cases, "skipped": skipped}


def _lines(result: dict) -> list[str]:
    return [f"copy bandwidth {result['limits']['copy_gb_s']} GB/s"] + [
        f"  {r['shape']} b={r['batch']} ctx={r['context']}: table {r['table_ms']} ms ({r['table_of_bandwidth']} of "
        f"bandwidth, {r['table']}), best {r['best_ms']} ms ({r['best_of_bandwidth']}, {r['best']})"
        for r in result["cases"]] + result["skipped"]


if __name__ == "__main__":
    bench_main(run, _lines)
