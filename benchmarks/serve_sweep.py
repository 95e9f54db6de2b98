"""`engine bench serve` at request rates 1, 4, 16 and unbounded against a running server, one JSON.

    python benchmarks/serve_sweep.py --url http://127.0.0.1:8000 --json benchmarks/results/serve-h200.json
"""

from __future__ import annotations

import argparse
import asyncio
import math

from engine.benchmarks.serve import _run, add_bench_serve_args, report

try:
    from common import write_result
except ImportError:
    from benchmarks.common import write_result

RATES = ((1.0, 32), (4.0, 64), (16.0, 128), (math.inf, 128))  # (requests/s, prompts)


def main() -> None:
    p = argparse.ArgumentParser()
    add_bench_serve_args(p)
    args = p.parse_args()
    out_path, sweeps = args.json, []
    for rate, n in RATES:
        args.request_rate, args.num_prompts, args.json = rate, n, None
        result = asyncio.run(_run(args))
        print(f"-- request rate {rate}\n{report(result)}", flush=True)
        sweeps.append(result)
    if out_path:
        write_result(out_path, {"benchmark": "serve_sweep", "runs": sweeps})


if __name__ == "__main__":
    main()
