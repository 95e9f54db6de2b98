"""Paged attention on the device: decode against the copy bandwidth, prefill against SDPA (flash).

Decode reads every sequence's K and V once; its floor is those bytes over the measured copy
bandwidth, and the figure is the achieved fraction of it. Prefill (causal) is judged in TFLOP/s
against ``scaled_dot_product_attention`` on the flash backend, same shapes, keys and values laid
out contiguously for it and in scattered pages for the engine's kernel.

    python benchmarks/attention_bench.py --json benchmarks/results/attention-h200.json
"""

from __future__ import annotations

import math

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from tqdm import tqdm

from engine.backends.triton.attention_decode import decode_attention
from engine.backends.triton.attention_prefill import prefill_attention
from engine.core.families.attention import AttentionLayer, LayerKV

try:
    from common import bench_main, bench_ms, measure_limits
except ImportError:  # run as a module
    from benchmarks.common import bench_main, bench_ms, measure_limits

PAGE = 16
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128  # Llama-3.1-8B
DECODE_BATCHES = (1, 8, 32, 64, 128, 256)
DECODE_CONTEXTS = (1024, 4096, 16384, 32768)
PREFILL_SHAPES = ((1, 1024, 128), (1, 4096, 128), (1, 8192, 128), (4, 2048, 128), (1, 4096, 64), (1, 4096, 256))
MAX_KV_BYTES = 40 * 2**30


def _paged(batch: int, ctx: int, head_dim: int, device, gen) -> tuple[LayerKV, torch.Tensor]:
    """K/V pages filled with random values, each sequence's pages scattered across the pool."""
    per_seq = ctx // PAGE
    k = torch.randn(batch * per_seq + 1, PAGE, KV_HEADS, head_dim, dtype=torch.bfloat16, device=device, generator=gen)
    v = torch.randn_like(k)
    order = torch.randperm(batch * per_seq, device=device, generator=gen) + 1  # page 0 is the null page
    return LayerKV(k, v), order.view(batch, per_seq).to(torch.int32)


def decode_case(batch: int, ctx: int, device, gen, copy_gb_s: float) -> dict:
    kv, table = _paged(batch, ctx, HEAD_DIM, device, gen)
    layer = AttentionLayer(0, HEADS, KV_HEADS, HEAD_DIM, 1 / math.sqrt(HEAD_DIM))
    q = torch.randn(batch, HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device, generator=gen)
    out = torch.full_like(q, float("nan"))
    starts = torch.arange(batch + 1, dtype=torch.int32, device=device)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    run = lambda: decode_attention(q, kv, layer, out, table, starts, lens, None)  # noqa: E731
    run()
    assert torch.isfinite(out).all(), "decode attention left outputs unwritten"
    ms = bench_ms(run)
    nbytes = 2 * batch * ctx * KV_HEADS * HEAD_DIM * 2 + 2 * q.numel() * 2 + table.numel() * 4
    gb_s = nbytes / ms / 1e6
    return {"batch": batch, "context": ctx, "ms": round(ms, 4), "gb_s": round(gb_s, 1),
            "fraction_of_copy_bw": round(gb_s / copy_gb_s, 3)}


def prefill_case(batch: int, seq: int, head_dim: int, device, gen) -> dict:
    kv, table = _paged(batch, seq, head_dim, device, gen)
    layer = AttentionLayer(0, HEADS, KV_HEADS, head_dim, 1 / math.sqrt(head_dim))
    q = torch.randn(batch * seq, HEADS, head_dim, dtype=torch.bfloat16, device=device, generator=gen)
    out = torch.full_like(q, float("nan"))
    starts = torch.arange(batch + 1, dtype=torch.int32, device=device) * seq
    lens = torch.full((batch,), seq, dtype=torch.int32, device=device)
    ids = torch.arange(batch, dtype=torch.int32, device=device)
    run = lambda: prefill_attention(q, kv, layer, out, table, starts, lens, ids, seq)  # noqa: E731
    run()
    assert torch.isfinite(out).all(), "prefill attention left outputs unwritten"
    ms = bench_ms(run)
    # the same keys, contiguous and with the KV heads repeated, for SDPA's flash kernel
    def dense(t):
        t = t[table.long()].reshape(batch, seq, KV_HEADS, head_dim)
        return t.repeat_interleave(HEADS // KV_HEADS, dim=2).transpose(1, 2).contiguous()
    k, v = dense(kv.k), dense(kv.v)
    qd = q.view(batch, seq, HEADS, head_dim).transpose(1, 2).contiguous()
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        ref = torch.nn.functional.scaled_dot_product_attention(qd, k, v, is_causal=True)
        sdpa_ms = bench_ms(lambda: torch.nn.functional.scaled_dot_product_attention(qd, k, v, is_causal=True))
    err = ((out.view(batch, seq, HEADS, head_dim).transpose(1, 2).float() - ref.float()).norm() / ref.float().norm()).item()
    flops = 4 * batch * HEADS * head_dim * seq * (seq + 1) / 2
    return {"batch": batch, "seq": seq, "head_dim": head_dim, "ms": round(ms, 4), "sdpa_ms": round(sdpa_ms, 4),
            "tflop_s": round(flops / ms / 1e9, 1), "sdpa_tflop_s": round(flops / sdpa_ms / 1e9, 1),
            "ratio_vs_sdpa": round(sdpa_ms / ms, 3), "rel_err_vs_sdpa": float(f"{err:.2e}")}


def run(device: torch.device, limits: dict | None = None) -> dict:
    gen = torch.Generator(device=device)
    gen.manual_seed(torch.seed() % 2**31)
    limits = limits or measure_limits(device)
    decode = []
    cases = [(b, c) for b in DECODE_BATCHES for c in DECODE_CONTEXTS if 4 * b * c * KV_HEADS * HEAD_DIM <= MAX_KV_BYTES]
    for b, c in tqdm(cases, desc="decode attention"):
        decode.append(decode_case(b, c, device, gen, limits["copy_gb_s"]))
        torch.cuda.empty_cache()
    prefill = [prefill_case(b, s, d, device, gen) for b, s, d in tqdm(PREFILL_SHAPES, desc="prefill attention")]
    return {"benchmark": "attention", "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                                                 "page_size": PAGE, "dtype": "bfloat16"},
            "limits": limits, "decode": decode, "prefill": prefill}


def summary(result: dict) -> list[str]:
    return ([f"decode b={r['batch']:4d} ctx={r['context']:6d}: {r['ms']:.3f} ms, {r['gb_s']:.0f} GB/s, "
             f"{r['fraction_of_copy_bw']:.2f} of copy" for r in result["decode"]]
            + [f"prefill b={r['batch']} s={r['seq']} d={r['head_dim']}: {r['tflop_s']} TFLOP/s, "
               f"SDPA {r['sdpa_tflop_s']} ({r['ratio_vs_sdpa']}x)" for r in result["prefill"]])


if __name__ == "__main__":
    bench_main(run, summary)
