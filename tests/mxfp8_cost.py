"""The numerical cost of DeepSeek-V4's MXFP8 attention output (``mxfp8_attention``) against the
unquantized path on one checkpoint: one engine each way reads the same held-out prompts; their
all-position logits are compared (max and mean |difference|, how often the argmax agrees), and
their greedy continuations (how many tokens they share before they first part).

On the CPU the Triton V4 attention runs in the interpreter in fp32 (its bf16 dots are not to be
trusted there); on a GPU the platform's backends run in bf16.

    python tests/mxfp8_cost.py MODEL_DIR [--prompts 8] [--tokens 96] [--new 8] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path

import torch

if __name__ == "__main__" and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel is decorated

from packed_logits import engine_logits  # noqa: E402

from engine.core.config import EngineConfig  # noqa: E402
from engine.core.engine import LLMEngine  # noqa: E402
from engine.core.plugins import load_plugins  # noqa: E402
from engine.core.sampling_params import SamplingParams  # noqa: E402

PAGE = 16
# what the tests hold the MXFP8 path to against the unquantized one, from the figures in the README
MEAN_LOGIT_ERROR = 0.15
MAX_LOGIT_ERROR = 3.0
ARGMAX_AGREEMENT = 0.8
GREEDY_AGREEMENT = 0.5  # of the continuations' tokens, those before they part (GPU test)


def held_out_prompts(engine: LLMEngine, text: str, count: int, tokens: int, seed: int) -> list[list[int]]:
    """``count`` runs of ``tokens`` ids from random places in ``text``."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        start = rng.randrange(len(text) - 40 * tokens)
        ids = engine.tokenizer.encode(text[start:start + 40 * tokens])
        prompts.append(ids[:tokens])
    return prompts


def make_engine(model: str, device: str, mxfp8: bool, pages: int) -> LLMEngine:
    if device == "cpu":
        from interpreted_triton import interpreted_triton

        config = EngineConfig(model=model, device="cpu", dtype="float32", page_size=PAGE, num_pages=pages,
                              v4_attention_backend="triton", mxfp8_attention=mxfp8)
        engine = LLMEngine(config, plugins=load_plugins(extra=[interpreted_triton()]), progress=False)
    else:
        config = EngineConfig(model=model, device=device, dtype="bfloat16", page_size=PAGE, num_pages=pages,
                              mxfp8_attention=mxfp8)
        engine = LLMEngine(config, progress=False)
    assert engine.components.model.model.attention.emits_mxfp8 is mxfp8
    return engine


def greedy(engine: LLMEngine, prompts: list[list[int]], new: int) -> list:
    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    outs = {}
    while engine.has_unfinished_requests():
        outs.update((o.request_id, o.outputs[0]) for o in engine.step() if o.finished)
    return [outs[str(i)] for i in range(len(prompts))]


def agreeing(a: list[int], b: list[int]) -> int:
    """Tokens two greedy continuations share before they first part."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def mxfp8_cost(model: str, text: str, device: str = "cpu", count: int = 8, tokens: int = 96, new: int = 8,
               seed: int = 0) -> dict:
    """The figures, MXFP8 against the unquantized path."""
    pages = count * -(-(tokens + new) // PAGE) + 4
    runs = {}
    for mxfp8 in (False, True):
        engine = make_engine(model, device, mxfp8, pages)
        prompts = held_out_prompts(engine, text, count, tokens, seed)
        logits = torch.cat(engine_logits(engine.components, prompts, PAGE)).float()
        runs[mxfp8] = logits, greedy(engine, prompts, new)
    (ref, ref_out), (got, got_out) = runs[False], runs[True]
    diff = (got - ref).abs()
    figures = {"device": device, "dtype": "float32" if device == "cpu" else "bfloat16", "prompts": count,
               "prompt_tokens": tokens, "new_tokens": new, "seed": seed,
               "logit_max_abs_error": diff.max().item(), "logit_mean_abs_error": diff.mean().item(),
               "logit_scale": ref.abs().mean().item(),
               "argmax_agreement": (got.argmax(-1) == ref.argmax(-1)).float().mean().item(),
               "greedy_identical": sum(a.token_ids == b.token_ids for a, b in zip(got_out, ref_out)),
               # of the continuations' tokens, those before their first difference
               "greedy_agreement": sum(agreeing(a.token_ids, b.token_ids) for a, b in zip(got_out, ref_out))
               / (count * new)}
    return figures


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--text", default=str(Path(__file__).resolve().parents[2] / "shared" / "data" / "python-eval.txt"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--new", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    figures = mxfp8_cost(args.model, Path(args.text).read_text(), args.device, args.prompts, args.tokens, args.new,
                         args.seed)
    print(json.dumps(figures, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()
