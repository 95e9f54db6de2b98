"""DeepSeek-V4.1's SWA bounded replay against a full prefill, on CPU: the first generated token's
logits and greedy agreement over the next tokens, at prompts shorter and longer than the window.

The model is the tests' tiny random V4.1 with an encoder/decoder split (tests/replay_steps.py:
hidden 32, 7 layers of which 3-6 are the decoder, a window of 8 tokens), one checkpoint per seed.
Its weights are random: no trained V4.1 exists yet, so these numbers say how far the replay moves a
model whose decoder attends over its window with no training behind it, not how far it moves
DeepSeek-V4.1-Flash. Per prompt length: the largest and mean of max|replay - full| / max|full| over
the first token's logits, how often their argmax agrees, and, greedy over ``--new-tokens``, how many
continuations are identical and the share of positions that agree.

    python benchmarks/swa_bounded_replay.py --json benchmarks/results/swa-bounded-replay-cpu.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tests' tiny random V4.1

from dsv41_random import random_v41_checkpoint, v41_config  # noqa: E402
from replay_steps import SPLIT, WINDOW, prompt_logits  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402

try:
    from common import commit, write_result
except ImportError:  # imported as benchmarks.swa_bounded_replay
    from benchmarks.common import commit, write_result

TOKENIZER = Path(__file__).resolve().parents[2] / "shared" / "models" / "tiny-dsv4-py"


def measure(seeds: list[int], lengths: list[int], prompts: int, new_tokens: int, tokenizer: Path) -> list[dict]:
    per_length: dict[int, list[dict]] = {n: [] for n in lengths}
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    for seed in seeds:
        with tempfile.TemporaryDirectory() as tmp:
            path = random_v41_checkpoint(Path(tmp), seed, v41_config(**SPLIT), tokenizer)
            full, replay = (LLM(str(path), dtype="float32", progress=False, page_size=4, enable_prefix_caching=False,
                                enable_swa_bounded_replay=on) for on in (False, True))
            rng = random.Random(seed)
            for n in lengths:
                batch = [[rng.randrange(128) for _ in range(n)] for _ in range(prompts)]
                want = [o.outputs[0].token_ids for o in full.generate(batch, params)]
                got = [o.outputs[0].token_ids for o in replay.generate(batch, params)]
                for prompt, w, g in zip(batch, want, got):
                    a, b = prompt_logits(full, prompt), prompt_logits(replay, prompt)
                    per_length[n].append({"rel": float((b - a).abs().max() / a.abs().max()),
                                          "argmax": int(a.argmax()) == int(b.argmax()), "identical": w == g,
                                          "agree": sum(x == y for x, y in zip(w, g)) / len(w)})
    rows = []
    for n, runs in per_length.items():
        rows.append({"prompt_tokens": n, "prompts": len(runs),
                     "first_token_rel_error_max": round(max(r["rel"] for r in runs), 6),
                     "first_token_rel_error_mean": round(sum(r["rel"] for r in runs) / len(runs), 6),
                     "first_token_argmax_agreement": round(sum(r["argmax"] for r in runs) / len(runs), 3),
                     "greedy_identical": sum(r["identical"] for r in runs),
                     "greedy_position_agreement": round(sum(r["agree"] for r in runs) / len(runs), 3)})
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seeds", type=int, default=4)
    p.add_argument("--prompts", type=int, default=6, help="prompts per length and seed")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--lengths", default="4,8,9,12,16,24,48,96")
    p.add_argument("--tokenizer", type=Path, default=TOKENIZER)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    rows = measure(list(range(args.seeds)), lengths, args.prompts, args.new_tokens, args.tokenizer)
    result = {"device": "cpu", "commit": commit(), "command": "python " + " ".join(sys.argv),
              "model": "tests/replay_steps.py SPLIT (random weights; no trained V4.1 exists)", "window": WINDOW,
              "seeds": args.seeds, "new_tokens": args.new_tokens, "rows": rows}
    print(json.dumps(rows, indent=1))
    if args.json:
        write_result(args.json, result)


if __name__ == "__main__":
    main()
