"""Multi-turn chat through the hierarchical KV cache: TTFT and throughput with L1 only, L1+L2 and
L1+L2+L3, the device cache a fraction (an eighth) of the working set.

``--conversations`` clients chat at once, each ``--turns`` turns: a turn's prompt is the shared
system prompt, every earlier user message and answer, and a new user message, so each turn
extends the last one's prefix (SGLang's bench_multiturn shape, random token ids, greedy answers
of ``--answer-len`` tokens with ignore_eos). The working set is every conversation's final
history (the system prompt once); the device gets ``--cache-fraction`` of it in pages. TTFT is
submit to first token per turn; throughput is the tokens generated (and prompt tokens served)
over the wall time of a configuration. Configurations, each a fresh engine:

- ``l1``: the prefix cache on the device only;
- ``l1_l2``: host memory below it, ``--host-ratio`` times the device's pages (8: the working set);
- ``l1_l2_l3``: a smaller host tier (``--host-ratio-with-storage``) and a file storage tier.

In the same run: with the storage tier, what its host side writes and reads per second (the KV's
pages as records into files and back, through the page cache); on CUDA, the host-to-device copy rate of one large pinned buffer, and what the
engine's layer-by-layer loader moves (the KV cache's own ``write_records`` staging and copy
stream, timed with CUDA events) and what the host side of a load checks and gathers per second
(the checksum of every record and the gather into one pinned batch), each over the
pinned rate where it is one.

    python benchmarks/hicache_multiturn.py --json benchmarks/results/hicache-multiturn-h200.json

A small CPU run shows the script works (its numbers say nothing of a GPU):

    python benchmarks/hicache_multiturn.py --model ../shared/models/tiny-qwen3-py --device cpu \\
        --conversations 4 --turns 3 --system-len 32 --user-len 16 --answer-len 4 --page-size 4 \\
        --prefetch-threshold 8
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import platform
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from engine.core.async_engine import AsyncLLM
from engine.core.config import EngineConfig, ModelConfig
from engine.core.engine import EngineCore
from engine.core.families.cache_tier import TierPage
from engine.core.sampling_params import SamplingParams

try:
    from common import commit, device_info, write_result
except ImportError:
    from benchmarks.common import commit, device_info, write_result

PRESET = "llama-3.1-8b"


def conversations(n: int, turns: int, system_len: int, user_len: int, vocab: int, seed: int):
    """The shared system prompt and each conversation's user messages, as random token ids."""
    rng = random.Random(seed)

    def tokens(k: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(k)]

    return tokens(system_len), [[tokens(user_len) for _ in range(turns)] for _ in range(n)]


def working_set_tokens(args) -> int:
    return args.system_len + args.conversations * args.turns * (args.user_len + args.answer_len)


async def chat(llm: AsyncLLM, cid: int, system: list[int], users: list[list[int]], params: SamplingParams) -> list[dict]:
    """One client's turns, each after the last one's answer; per turn its TTFT, prompt and cached tokens."""
    history, turns = list(system), []
    for t, user in enumerate(users):
        prompt = history + user
        start, first, out = time.perf_counter(), None, None
        async for out in llm.generate(prompt, params, f"c{cid}-t{t}"):
            if first is None and out.outputs[0].token_ids:
                first = time.perf_counter()
        answer = out.outputs[0].token_ids
        turns.append({"turn": t, "ttft_s": first - start, "prompt_tokens": len(prompt),
                      "cached_tokens": out.num_cached_tokens, "output_tokens": len(answer)})
        history = prompt + answer
    return turns


def _summary(values: list[float]) -> dict:
    if not values:
        return {}
    ordered = sorted(values)
    return {"mean": round(statistics.fmean(ordered), 4), "median": round(statistics.median(ordered), 4),
            "p90": round(ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))], 4)}


def engine_config(args, num_pages: int, max_model_len: int, **hicache) -> EngineConfig:
    return EngineConfig(model=str(args.model), device=args.device, dtype=args.dtype, page_size=args.page_size,
                        num_pages=num_pages, max_model_len=max_model_len, **hicache)


def run_config(name: str, config: EngineConfig, args, system, users) -> tuple[dict, EngineCore]:
    core = EngineCore(config, progress=False)
    llm = AsyncLLM(core)
    params = SamplingParams(max_tokens=args.answer_len, temperature=0, ignore_eos=True)

    async def clients():
        return await asyncio.gather(*(chat(llm, i, system, u, params) for i, u in enumerate(users)))

    start = time.perf_counter()
    per_client = asyncio.run(clients())
    wall = time.perf_counter() - start
    llm.shutdown()
    turns = [t for c in per_client for t in c]
    later = [t for t in turns if t["turn"] > 0]  # the turns that can hit the last one's history
    prompt_tokens = sum(t["prompt_tokens"] for t in turns)
    output_tokens = sum(t["output_tokens"] for t in turns)
    stats = core.stats().hicache
    result = {
        "config": name, "seconds": round(wall, 3),
        "ttft_s": _summary([t["ttft_s"] for t in turns]), "ttft_later_turns_s": _summary([t["ttft_s"] for t in later]),
        "ttft_by_turn_s": [round(statistics.fmean(t["ttft_s"] for t in turns if t["turn"] == k), 4)
                           for k in range(args.turns)],
        "hit_rate_later_turns": round(sum(t["cached_tokens"] for t in later) / max(1, sum(t["prompt_tokens"] for t in later)), 4),
        "output_tokens_per_s": round(output_tokens / wall, 2),
        "prompt_tokens_per_s": round(prompt_tokens / wall, 2),
        "preemptions": core.scheduler.stats.num_preemptions,
        "hicache": ({"hit_tokens": stats.hit_tokens, "bytes_written": stats.bytes_written,
                     "bytes_read": stats.bytes_read, "checksum_failures": stats.checksum_failures,
                     "storage_failures": stats.storage_failures} if stats is not None else None),
        "settings": {k: getattr(config, k) for k in ("num_pages", "page_size", "enable_hierarchical_cache",
                                                     "hicache_ratio", "hicache_storage_backend",
                                                     "hicache_storage_prefetch_policy")},
    }
    return result, core


def _cuda_ms(fn, device: torch.device, reps: int = 5) -> float:
    """Median device ms of ``fn`` (events on the current stream around it)."""
    times = []
    for _ in range(reps + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[1:])


def load_bandwidth(core: EngineCore, device: torch.device, target_bytes: int) -> dict:
    """GB/s of a pinned host-to-device copy, of the engine's layer-by-layer load of pages (the bytes
    staged from pinned records and copied on its stream), and of a load's host side (checksums, on
    the hierarchy's threads, and the gather into one pinned batch) for as many pages as fit
    ``target_bytes``."""
    kv = core.components.kv
    record_bytes = sum(kv.record_segments())
    count = max(1, min(kv.num_pages - 1, target_bytes // record_bytes))
    pages = list(range(1, count + 1))
    records = kv.read_records(pages).pin_memory()
    nbytes = records.numel()
    flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
    pinned_ms = _cuda_ms(lambda: flat.copy_(records.view(-1), non_blocking=True), device)

    def layer_load():  # the pages' own bytes written back: the cache is unchanged
        kv.write_records(pages, records)
        kv.loads.flush()

    load_ms = _cuda_ms(layer_load, device)
    tier_records = [TierPage.of(str(i), r) for i, r in enumerate(records)]
    start = time.perf_counter()
    checked = core.kv_manager.lower.intact(tier_records)  # as a load checks them, on its threads
    batch = torch.empty(count, record_bytes, dtype=torch.uint8, pin_memory=True)
    torch.stack([r.data for r in tier_records], out=batch)
    host_s = time.perf_counter() - start
    assert all(checked)
    pinned = nbytes / pinned_ms / 1e6
    loaded = nbytes / load_ms / 1e6
    return {"bytes": nbytes, "pages": count, "pinned_copy_gb_s": round(pinned, 2),
            "layer_load_gb_s": round(loaded, 2), "layer_load_over_pinned": round(loaded / pinned, 3),
            "host_side_gb_s": round(nbytes / host_s / 1e9, 2),
            "host_side_over_pinned": round(nbytes / host_s / 1e9 / pinned, 3)}


def storage_bandwidth(core: EngineCore, directory: Path, target_bytes: int, reps: int = 3) -> dict:
    """GB/s of the storage tier's host side: ``target_bytes`` of the KV's pages put as records into
    a fresh directory and got back, the best of ``reps`` rounds (fresh keys each): the copies
    between the records and the files, through the page cache. Checksums are taken before and
    checked after, untimed."""
    tier = core.kv_manager.lower.reader.tier
    kv = core.components.kv
    record_bytes = sum(kv.record_segments())
    count = max(1, target_bytes // record_bytes)
    rows = kv.read_records([1 + i % (kv.num_pages - 1) for i in range(count)])  # the cache's pages, over again
    ctx = dataclasses.replace(tier.ctx, engine_config=dataclasses.replace(tier.ctx.engine_config,
                                                                          hicache_storage_dir=str(directory)))
    files = type(tier)(ctx)
    write_s = read_s = float("inf")
    for rep in range(reps):
        records = [TierPage.of(f"{rep:04x}{i:028x}", r) for i, r in enumerate(rows)]
        start = time.perf_counter()
        assert all(files.put(records))
        write_s = min(write_s, time.perf_counter() - start)
        start = time.perf_counter()
        got = files.get([r.key for r in records])
        read_s = min(read_s, time.perf_counter() - start)
        assert all(g is not None and g.intact() for g in got)
    nbytes = rows.numel()
    return {"bytes": nbytes, "records": count, "record_bytes": record_bytes, "tier": tier.name,
            "write_gb_s": round(nbytes / write_s / 1e9, 3), "read_gb_s": round(nbytes / read_s / 1e9, 3)}


def _release(core: EngineCore | None) -> None:
    if core is not None:
        core.shutdown()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a checkpoint directory (default: --preset's, random weights)")
    p.add_argument("--preset", default=PRESET, help=f"an engine.checkpoints preset written with random weights ({PRESET})")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--conversations", type=int, default=32)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--system-len", type=int, default=1024, help="tokens of the system prompt every conversation shares")
    p.add_argument("--user-len", type=int, default=256, help="tokens of each user message")
    p.add_argument("--answer-len", type=int, default=64, help="tokens of each answer")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--cache-fraction", type=float, default=1 / 8, help="device KV pages as a fraction of the working set")
    p.add_argument("--host-ratio", type=float, default=8.0, help="host records per device page, L1+L2")
    p.add_argument("--host-ratio-with-storage", type=float, default=2.0, help="host records per device page, L1+L2+L3")
    p.add_argument("--storage-dir", default=None, help="the file tier's directory (default: a fresh temporary one)")
    p.add_argument("--prefetch-policy", default="wait_complete", choices=("best_effort", "wait_complete", "timeout"))
    p.add_argument("--prefetch-threshold", type=int, default=256)
    p.add_argument("--configs", default="l1,l1_l2,l1_l2_l3")
    p.add_argument("--bandwidth-bytes", type=int, default=1 << 30,
                   help="bytes of pages the load bandwidth (CUDA) and the storage tier's rates move")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    device = torch.device(args.device)
    args.dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    scratch = Path(tempfile.mkdtemp(prefix="engine-hicache-bench-"))
    try:
        preset = None
        if args.model is None:
            from engine.checkpoints import write_checkpoint

            preset = args.preset
            args.model = write_checkpoint(scratch / preset, preset)
        ws = working_set_tokens(args)
        longest = args.system_len + args.turns * (args.user_len + args.answer_len)
        num_pages = max(-(-int(ws * args.cache_fraction) // args.page_size), -(-longest // args.page_size) + 2)
        max_model_len = longest + args.page_size
        storage = Path(args.storage_dir) if args.storage_dir else scratch / "storage"
        configs = {
            "l1": {},
            "l1_l2": {"enable_hierarchical_cache": True, "hicache_ratio": args.host_ratio},
            "l1_l2_l3": {"enable_hierarchical_cache": True, "hicache_ratio": args.host_ratio_with_storage,
                         "hicache_storage_backend": "file", "hicache_storage_dir": str(storage),
                         "hicache_storage_prefetch_policy": args.prefetch_policy,
                         "hicache_storage_prefetch_threshold": args.prefetch_threshold},
        }
        chosen = args.configs.split(",")
        if unknown := set(chosen) - set(configs):
            raise SystemExit(f"--configs: unknown {sorted(unknown)}; known: {list(configs)}")
        vocab = ModelConfig.from_dir(args.model).vocab_size
        system, users = conversations(args.conversations, args.turns, args.system_len, args.user_len, vocab, args.seed)
        results, bandwidth, storage_rate = [], None, None
        for name in chosen:
            core = None
            try:
                config = engine_config(args, num_pages, max_model_len, **configs[name])
                result, core = run_config(name, config, args, system, users)
                results.append(result)
                print(f"{name}: TTFT mean {result['ttft_s'].get('mean')} s (later turns "
                      f"{result['ttft_later_turns_s'].get('mean')} s, hit rate {result['hit_rate_later_turns']}), "
                      f"{result['output_tokens_per_s']} output tok/s, {result['seconds']} s", flush=True)
                if name == "l1_l2_l3":
                    storage_rate = storage_bandwidth(core, scratch / "bandwidth", args.bandwidth_bytes)
                    print(f"storage tier ({storage_rate['tier']}, {storage_rate['records']} records of "
                          f"{storage_rate['record_bytes']} B): write {storage_rate['write_gb_s']} GB/s, read "
                          f"{storage_rate['read_gb_s']} GB/s", flush=True)
                if name == "l1_l2" and device.type == "cuda":
                    bandwidth = load_bandwidth(core, device, args.bandwidth_bytes)
                    print(f"host-to-device: pinned copy {bandwidth['pinned_copy_gb_s']} GB/s, layer-by-layer load "
                          f"{bandwidth['layer_load_gb_s']} GB/s ({bandwidth['layer_load_over_pinned']}), host side "
                          f"{bandwidth['host_side_gb_s']} GB/s", flush=True)
            finally:
                _release(core)
        base = next((r for r in results if r["config"] == "l1"), None)
        if base is not None:
            for r in results:
                r["ttft_later_turns_vs_l1"] = round(base["ttft_later_turns_s"]["mean"] / r["ttft_later_turns_s"]["mean"], 3)
                r["throughput_vs_l1"] = round(r["output_tokens_per_s"] / base["output_tokens_per_s"], 3)
        out = {"benchmark": "hicache_multiturn", "commit": commit(), "model": preset or str(args.model),
               "random_weights": preset is not None, "dtype": args.dtype,
               "device": device_info(device) if device.type == "cuda" else {"name": "cpu", "host": platform.node()},
               "workload": {k: getattr(args, k) for k in ("conversations", "turns", "system_len", "user_len",
                                                           "answer_len", "page_size", "cache_fraction", "seed")},
               "working_set_tokens": ws, "device_pages": num_pages, "results": results, "load_bandwidth": bandwidth,
               "storage_bandwidth": storage_rate}
        if args.json:
            write_result(args.json, out)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
