"""Page checksum throughput on this host's CPU, one core: the hashes a KV page's checksum could use.

Every page that crosses a cache tier, and every page a prefill engine sends a decode engine, is
hashed where it is written and again where it is read, so the hash bounds the host side of a
load. Candidates: the standard library's (BLAKE2b, SHA-256 (SHA-NI where the CPU has it), SHA-1,
MD5, CRC-32, Adler-32) and two maintained packages, XXH3 (``xxhash``, not cryptographic) and
BLAKE3 (``blake3``, cryptographic). Records of ``--sizes`` bytes (default: a page of 16 tokens
of Llama-3.1-8B in bf16, 2 MiB, and of the tiny test models, a few KiB); the best of
``--repeats`` timings of hashing ``--bytes`` in all.

    python benchmarks/page_checksums.py --json benchmarks/results/page-checksums-cpu.json
"""

from __future__ import annotations

import argparse
import hashlib
import platform
import time
import zlib

import blake3
import numpy as np
import xxhash

try:
    from common import commit, write_result
except ImportError:
    from benchmarks.common import commit, write_result

HASHES = {
    "blake2b-128": lambda b: hashlib.blake2b(b, digest_size=16).digest(),
    "sha256": lambda b: hashlib.sha256(b).digest(),
    "sha1": lambda b: hashlib.sha1(b).digest(),
    "md5": lambda b: hashlib.md5(b).digest(),
    "crc32": zlib.crc32,
    "adler32": zlib.adler32,
    "xxh3-128": xxhash.xxh3_128_digest,
    "blake3-128": lambda b: blake3.blake3(b).digest(16),
}
LLAMA_8B_PAGE = 16 * 32 * 2 * 8 * 128 * 2  # tokens x layers x (K, V) x KV heads x head dim x bf16 bytes


def gb_per_s(fn, record: np.ndarray, total: int, repeats: int) -> float:
    count = max(1, total // record.nbytes)
    fn(record)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(count):
            fn(record)
        best = min(best, time.perf_counter() - start)
    return count * record.nbytes / best / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[LLAMA_8B_PAGE, 4096])
    p.add_argument("--bytes", type=int, default=256 << 20, help="bytes hashed per timing")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    results = {}
    for size in args.sizes:
        record = rng.integers(0, 256, size, dtype=np.uint8)
        results[str(size)] = {name: round(gb_per_s(fn, record, args.bytes, args.repeats), 3)
                              for name, fn in HASHES.items()}
        print(f"{size} B records: " + ", ".join(f"{k} {v} GB/s" for k, v in results[str(size)].items()), flush=True)
    if args.json:
        write_result(args.json, {"benchmark": "page_checksums", "commit": commit(), "gb_per_s_one_core": results,
                                 "cpu": platform.processor() or platform.machine(), "host": platform.node(),
                                 "xxhash": xxhash.VERSION, "blake3": blake3.__version__})


if __name__ == "__main__":
    main()
