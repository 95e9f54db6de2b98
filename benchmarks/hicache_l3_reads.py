"""Pages a second from the storage tier (L3) in a prefetch: the existence check and the reads of a
long prefix hit, as a request's prefetch makes them (core/kv/prefetch.py, policy wait_complete).

Tiers: ``file`` (core/tiers/file.py, a directory: --dir, default a temporary one under /tmp),
``nixl-posix`` (NIXL's POSIX plugin on the same layout), ``nixl-obj`` (NIXL's OBJ plugin
against moto's S3 server on loopback, tests/plugins/s3_loopback.py) and ``nixl-obj-delayed`` (the
same server holding each request ``--s3-delay-ms``, a store at a network's distance: on loopback
the server's CPU, about a hundred requests a second here, is otherwise the whole cost). The NIXL
ones need ``pip install nixl-cu12 moto[server] boto3`` (skipped where missing). Each run writes
``--pages`` records of ``--record-kib`` KiB, then times ``--repeats`` prefetches of all of them
from a reader that has none; the JSON gives each tier's pages/s (median, min, max), MB/s and, for
S3, the requests a prefetch made by method and the most the server answered at once; every record
must come back intact.

    python benchmarks/hicache_l3_reads.py --json benchmarks/results/hicache-l3-reads-cpu.json
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid

import torch

try:
    from common import commit, write_result
except ImportError:
    from benchmarks.common import commit, write_result

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "plugins"))  # s3_loopback

from engine.core.config import EngineConfig
from engine.core.families.cache_tier import TierContext, TierLayout, TierPage, prefix_keys
from engine.core.kv.prefetch import StorageReader
from engine.core.tiers.file import FileTier

PAGE_SIZE = 16  # tokens a page; only the keys depend on it


def have_nixl() -> bool:
    if importlib.util.find_spec("nixl") is None:
        return False
    from s3_loopback import import_nixl

    import_nixl()
    return True


def context(layout: TierLayout, **config) -> TierContext:
    return TierContext(None, None, EngineConfig(model="-", enable_hierarchical_cache=True, **config), layout)


def file_tier(layout, directory):
    return FileTier(context(layout, hicache_storage_backend="file", hicache_storage_dir=directory))


def nixl_posix_tier(layout, directory):
    from engine.plugins import nixl

    nixl.FILE_PLUGINS = ("POSIX",)
    return nixl.NixlFileTier(context(layout, hicache_storage_backend="nixl", hicache_storage_dir=directory))


def nixl_obj_tier(layout, directory, delay_s: float):
    import boto3
    from s3_loopback import LoopbackS3

    from engine.plugins.nixl_obj import NixlObjectTier

    server = LoopbackS3(delay_s)
    bucket = f"kv-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=server.url, region_name="us-east-1", aws_access_key_id="test",
                 aws_secret_access_key="test").create_bucket(Bucket=bucket)
    options = {"nixl": {"plugin": "OBJ", "endpoint_override": server.url, "bucket": bucket, "access_key": "test",
                        "secret_key": "test"}}
    return NixlObjectTier(context(layout, hicache_storage_backend="nixl", plugin_options=options)), server


TIERS = {"file": file_tier, "nixl-posix": nixl_posix_tier, "nixl-obj": nixl_obj_tier,
         "nixl-obj-delayed": nixl_obj_tier}


def measure(name: str, pages: int, record_bytes: int, repeats: int, directory: str, delay_s: float) -> dict:
    layout = TierLayout({"page": (record_bytes,)}, f"bench-{uuid.uuid4().hex[:8]}")
    if name.startswith("nixl-obj"):
        tier, server = nixl_obj_tier(layout, directory, delay_s if name == "nixl-obj-delayed" else 0.0)
    else:
        tier, server = TIERS[name](layout, directory), None
    try:
        keys = prefix_keys(list(range(pages * PAGE_SIZE)), PAGE_SIZE, layout.model)
        g = torch.Generator().manual_seed(0)
        records = [TierPage.of(k, torch.randint(0, 256, (record_bytes,), dtype=torch.uint8, generator=g)) for k in keys]
        assert all(tier.put(records)), tier.last_error
        seconds = []
        if server is not None:
            server.reset()
        for _ in range(repeats):
            reader = StorageReader(tier, "wait_complete", PAGE_SIZE, PAGE_SIZE, record_bytes)
            start = time.perf_counter()
            p = reader.start(keys, 0)
            got = reader.take(p) if p is not None else []
            seconds.append(time.perf_counter() - start)
            reader.close()
            if len(got) != pages or not all(r.key == k and r.intact() for r, k in zip(got, keys)):
                raise RuntimeError(f"{name}: {len(got)} of {pages} records came back intact")
        rates = sorted(pages / s for s in seconds)
        return {"pages": pages, "record_bytes": record_bytes, "repeats": repeats,
                "pages_per_s": {"median": round(statistics.median(rates), 1), "min": round(rates[0], 1),
                                "max": round(rates[-1], 1)},
                "mb_per_s_median": round(statistics.median(rates) * record_bytes / 1e6, 1),
                "plugin": getattr(tier, "plugin", None),
                **({"s3_delay_ms": delay_s * 1e3 if name == "nixl-obj-delayed" else 0.0,
                    "s3_requests_per_prefetch": {m: n / repeats for m, n in server.requests.items()},
                    "s3_most_at_once": server.most_at_once} if server is not None else {})}
    finally:
        if server is not None:
            server.stop()


def arguments(description: str) -> argparse.ArgumentParser:
    """The options of a storage-tier benchmark (this one's and hicache_l3_writes.py's)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--tiers", nargs="+", default=list(TIERS), choices=list(TIERS))
    p.add_argument("--pages", type=int, default=128)
    p.add_argument("--record-kib", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--s3-delay-ms", type=float, default=5.0,
                   help="nixl-obj-delayed: how long the S3 server holds each request (a network round trip)")
    p.add_argument("--dir", default=None, help="where the directory tiers write (default: a new one under /tmp)")
    p.add_argument("--label", default="", help="what the code measured is (before / after a change)")
    p.add_argument("--json", default=None)
    return p


def over_tiers(benchmark: str, args, measure, line) -> None:
    """``measure(tier name, directory)`` of each tier asked for (a NIXL one where nixl is installed),
    in a new directory each; ``line(result)`` printed for each; the JSON written where asked."""
    nixl_here = have_nixl()
    results = {}
    for name in args.tiers:
        if name.startswith("nixl") and not nixl_here:
            print(f"{name}: skipped (nixl is not installed)")
            continue
        with tempfile.TemporaryDirectory(dir=args.dir) as directory:
            results[name] = measure(name, directory)
        print(f"{name}: {line(results[name])}", flush=True)
    if args.json:
        write_result(args.json, {
            "benchmark": benchmark, "label": args.label, "commit": commit(),
            "command": "python " + " ".join(sys.argv),
            "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load "
                       f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}",
            "tiers": results})


def main() -> None:
    args = arguments(__doc__.split("\n\n")[0]).parse_args()
    over_tiers("hicache_l3_reads", args,
               lambda name, directory: measure(name, args.pages, args.record_kib << 10, args.repeats, directory,
                                               args.s3_delay_ms / 1e3),
               lambda r: f"{r['pages_per_s']['median']} pages/s ({r['pages_per_s']['min']}-{r['pages_per_s']['max']}), "
                         f"{r['mb_per_s_median']} MB/s")


if __name__ == "__main__":
    main()
