"""Pages a second into the storage tier (L3), and the time of the existence check a prefetch makes
first (``contains`` of a run of keys), per tier.

The tiers are hicache_l3_reads.py's (``file``, ``nixl-posix``, ``nixl-obj`` on moto's S3 server on
loopback, ``nixl-obj-delayed`` with each request held ``--s3-delay-ms``). Each repeat writes
``--pages`` new records of ``--record-kib`` KiB in one ``put`` (as the storage writer hands them
over, core/kv/storage_writer.py), then times ``contains`` of the first ``--check`` keys; every
record must then come back intact. ``--fill`` puts that many more files into a directory tier
first (a store that has grown), where the alternative to a stat a key, a scan of the run's shard
directories, is timed too (``shard_scan_us``). For S3 the JSON gives the requests a ``put`` made
by method and the most the server answered at once.

    python benchmarks/hicache_l3_writes.py --json benchmarks/results/hicache-l3-writes-cpu.json
"""

from __future__ import annotations

import os
import statistics
import time
import uuid

import torch

try:
    from hicache_l3_reads import PAGE_SIZE, TIERS, arguments, nixl_obj_tier, over_tiers
except ImportError:
    from benchmarks.hicache_l3_reads import PAGE_SIZE, TIERS, arguments, nixl_obj_tier, over_tiers

from engine.core.families.cache_tier import TierLayout, TierPage, prefix_keys
from engine.core.tiers.file import record_name


def spread(rates: list[float], digits: int = 1) -> dict:
    rates = sorted(rates)
    return {"median": round(statistics.median(rates), digits), "min": round(rates[0], digits),
            "max": round(rates[-1], digits)}


def fill(root: str, n: int) -> None:
    """``n`` files named as records (empty: only their names matter to a stat or a scan)."""
    for i in range(n):
        path = os.path.join(root, record_name(uuid.uuid4().hex))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        open(path, "wb").close()


def shard_scan(root: str, keys: list[str]) -> int:
    """The existence check as a listing of each shard directory the keys lie in."""
    listed: dict[str, set[str]] = {}
    for key in keys:
        shard = os.path.dirname(record_name(key))
        if shard not in listed:
            try:
                listed[shard] = set(os.listdir(os.path.join(root, shard)))
            except OSError:
                listed[shard] = set()
    return next((i for i, k in enumerate(keys) if os.path.basename(record_name(k)) not in
                 listed[os.path.dirname(record_name(k))]), len(keys))


def measure(name: str, args, directory: str) -> dict:
    record_bytes = args.record_kib << 10
    layout = TierLayout({"page": (record_bytes,)}, f"bench-{uuid.uuid4().hex[:8]}")
    if name.startswith("nixl-obj"):
        tier, server = nixl_obj_tier(layout, directory, args.s3_delay_ms / 1e3 if name == "nixl-obj-delayed" else 0.0)
    else:
        tier, server = TIERS[name](layout, directory), None
        fill(directory, args.fill)
    try:
        g = torch.Generator().manual_seed(0)
        rates, checks, scans = [], [], []
        for r in range(args.repeats):
            keys = prefix_keys(list(range(args.pages * PAGE_SIZE)), PAGE_SIZE, f"{layout.model}-{r}")  # new each repeat
            records = [TierPage.of(k, torch.randint(0, 256, (record_bytes,), dtype=torch.uint8, generator=g))
                       for k in keys]
            if server is not None:
                server.reset()
            start = time.perf_counter()
            done = tier.put(records)
            rates.append(args.pages / (time.perf_counter() - start))
            if not all(done):
                raise RuntimeError(f"{name}: {len(done) - sum(done)} of {args.pages} writes refused "
                                   f"({tier.last_error})")
            requests = dict(server.requests) if server is not None else None
            most = server.most_at_once if server is not None else None
            run = keys[:args.check]
            start = time.perf_counter()
            held = tier.contains(run)
            checks.append((time.perf_counter() - start) * 1e6)
            if held != len(run):
                raise RuntimeError(f"{name}: the check found {held} of {len(run)} records")
            if server is None:
                start = time.perf_counter()
                shard_scan(directory, run)
                scans.append((time.perf_counter() - start) * 1e6)
            got = tier.get(keys)
            if not all(g is not None and g.intact() and torch.equal(g.data, rec.data) for g, rec in zip(got, records)):
                raise RuntimeError(f"{name}: a record written did not come back intact")
        return {"pages": args.pages, "record_bytes": record_bytes, "repeats": args.repeats,
                "write_pages_per_s": spread(rates),
                "write_mb_per_s_median": round(statistics.median(rates) * record_bytes / 1e6, 1),
                "check_keys": args.check, "contains_us": spread(checks, 0),
                "plugin": getattr(tier, "plugin", None),
                **({"fill": args.fill, "shard_scan_us": spread(scans, 0)} if server is None else
                   {"s3_delay_ms": args.s3_delay_ms if name == "nixl-obj-delayed" else 0.0,
                    "s3_requests_per_put": requests, "s3_most_at_once_in_put": most})}
    finally:
        if server is not None:
            server.stop()


def main() -> None:
    p = arguments(__doc__.split("\n\n")[0])
    p.add_argument("--check", type=int, default=128, help="keys in the timed existence check")
    p.add_argument("--fill", type=int, default=0, help="files put into a directory tier first")
    args = p.parse_args()
    over_tiers("hicache_l3_writes", args, lambda name, directory: measure(name, args, directory),
               lambda r: f"writes {r['write_pages_per_s']['median']} pages/s ({r['write_pages_per_s']['min']}-"
                         f"{r['write_pages_per_s']['max']}), contains of {r['check_keys']} "
                         f"{r['contains_us']['median']:.0f} us"
                         + (f", shard scan {r['shard_scan_us']['median']:.0f} us" if "shard_scan_us" in r else ""))


if __name__ == "__main__":
    main()
