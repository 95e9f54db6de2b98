"""End-to-end decode on the device with random bf16 weights, next to its roofline and to HF.

A preset ending in ``-fp8`` is its bf16 checkpoint written in the fine-grained FP8 layout
(``write_fp8_block``: E4M3 projections with 128x128 fp32 block scales, as Qwen's ``*-FP8``
checkpoints are published), served resident through the FP8 block GEMM; its roofline counts the
bytes it holds, its rows say ``fp8_vs_bf16`` beside the bf16 preset's where both ran, and HF is
not run on it.

For each batch size the engine generates ``--decode`` tokens after a 1K-token prompt (ignore_eos,
greedy, prefix cache off); decode tokens/s is batch x decode over the time beyond a
one-token run of the same prompts (prefill and first token), so prefill stays out of it. The
roofline of a step is its bytes (every weight once, plus each sequence's KV) over the measured
copy bandwidth. HF transformers generates the same prompts on the same device the same way. Batch 1
is measured again with seeded top-p sampling (temperature 0.8, top-p 0.95, ``top_p_vs_greedy``: it
should cost little beside greedy), and once more with each of two speed-ups off, to show what it
gives: ``overlap_decode`` (each step is launched before the last one's tokens are read) and
programmatic dependent launch (``ENGINE_PDL=0``).

    python benchmarks/e2e_decode.py --json benchmarks/results/e2e-h200.json

``E2E_PRESETS=qwen3-0.6b`` (comma-separated) measures only those presets; ``E2E_HF=0`` leaves HF out.
FP8 against bf16 at the Llama-3.1-8B shape:

    E2E_PRESETS=llama-3.1-8b,llama-3.1-8b-fp8 E2E_HF=0 python benchmarks/e2e_decode.py --json benchmarks/results/e2e-fp8-h200.json
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import random
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

from engine import LLM, SamplingParams
from engine.backends.triton import pdl
from engine.checkpoints import write_checkpoint
from engine.checkpoints.fp8_block import write_fp8_block

try:
    from common import bench_main, measure_limits, sync
except ImportError:
    from benchmarks.common import bench_main, measure_limits, sync

CASES = (("llama-3.1-8b", (1, 8, 64, 256)), ("llama-3.1-8b-fp8", (1, 8, 64, 256)), ("qwen3-0.6b", (1,)))
FP8 = "-fp8"
GREEDY = SamplingParams(temperature=0, ignore_eos=True)
TOP_P = SamplingParams(temperature=0.8, top_p=0.95, seed=1234, ignore_eos=True)
HF_MAX_BATCH = 64  # HF's cache at 256 x 1K adds minutes for a figure nobody would serve with
WITHOUT = {  # key: what is off, the LLM's options, the environment
    "no_overlap": ("without overlapped decode", {"overlap_decode": False}, {}),
    "no_pdl": ("without programmatic dependent launch", {}, {"ENGINE_PDL": "0"}),
}


@contextlib.contextmanager
def _environment(env: dict[str, str]):
    """``env`` set while the block runs (and the kernels' launch options read afresh)."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    pdl.reset()
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v
        pdl.reset()


def _prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(batch)]


def _cases(presets: str | None) -> tuple:
    """CASES, or those named in ``presets`` (comma-separated)."""
    if not presets:
        return CASES
    names = presets.split(",")
    if unknown := set(names) - {preset for preset, _ in CASES}:
        raise ValueError(f"E2E_PRESETS: unknown {sorted(unknown)}; known: {[preset for preset, _ in CASES]}")
    return tuple(case for case in CASES if case[0] in names)


def _checkpoint(root: Path, preset: str, device: torch.device) -> Path:
    """The preset's random-weight checkpoint under ``root``; an FP8 one from its bf16 checkpoint."""
    base = preset.removesuffix(FP8)
    path = root / base
    if not path.exists():
        write_checkpoint(path, base)
    if preset == base:
        return path
    write_fp8_block(path, root / preset, device)
    return root / preset


def _engine_decode(llm: LLM, prompts, decode: int, params: SamplingParams = GREEDY) -> float:
    def run(n: int) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        outs = llm.generate(prompts, dataclasses.replace(params, max_tokens=n))
        torch.cuda.synchronize()
        assert all(len(o.outputs[0].token_ids) == n for o in outs)
        return time.perf_counter() - t

    run(1 + decode)  # warm-up over every shape the timed runs see, so no kernel compiles inside them
    return len(prompts) * decode / (run(1 + decode) - run(1))


def _hf_decode(model, prompts, decode: int) -> float:
    ids = torch.tensor(prompts, device=model.device)

    def run(n: int) -> float:
        sync()
        t = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0)
        sync()
        assert out.shape[1] == ids.shape[1] + n
        return time.perf_counter() - t

    run(1 + decode)
    return len(prompts) * decode / (run(1 + decode) - run(1))


def _roofline(config: dict, batch: int, ctx: int, copy_gb_s: float, weight_bytes: int) -> float:
    kv_per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config.get(
        "head_dim", config["hidden_size"] // config["num_attention_heads"]) * 2
    step_bytes = weight_bytes + batch * ctx * kv_per_token
    return batch / (step_bytes / (copy_gb_s * 1e9))


def run(device: torch.device, limits: dict | None = None, prompt_len: int = 1024, decode: int = 32,
        hf: bool = True, cases: tuple = CASES) -> dict:
    """Prints each figure as it is measured (the checkpoints take minutes to write)."""
    import json

    limits = limits or measure_limits(device)
    results = []
    root = Path(tempfile.mkdtemp(prefix="engine-e2e-"))
    for preset, batches in cases:
        path = _checkpoint(root, preset, device)
        config = json.loads((path / "config.json").read_text())
        weight_bytes = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        llm = LLM(str(path), dtype="bfloat16", enable_prefix_caching=False, max_model_len=prompt_len + decode + 8,
                  max_num_seqs=max(batches))
        backends = {f: s.chosen.name for f, s in llm.engine.components.selections.items()}
        rows = []
        for b in batches:
            prompts = _prompts(b, prompt_len, config["vocab_size"], b)
            tps = _engine_decode(llm, prompts, decode)
            roof = _roofline(config, b, prompt_len + decode // 2, limits["copy_gb_s"], weight_bytes)
            rows.append({"batch": b, "engine_tok_s": round(tps, 1), "roofline_tok_s": round(roof, 1),
                         "fraction_of_roofline": round(tps / roof, 3)})
            print(f"{preset} batch {b}: {tps:.1f} tok/s, roofline {roof:.1f} ({tps / roof:.2f})", flush=True)
            if b == 1:
                top_p = _engine_decode(llm, prompts, decode, TOP_P)
                rows[-1].update(engine_tok_s_top_p=round(top_p, 1), top_p_vs_greedy=round(top_p / tps, 3))
                print(f"{preset} batch 1 seeded top-p: {top_p:.1f} tok/s ({top_p / tps:.3f} of greedy)", flush=True)
        del llm
        gc.collect()
        torch.cuda.empty_cache()
        for key, (what, options, env) in WITHOUT.items():  # batch 1 again with one speed-up off
            with _environment(env):
                llm = LLM(str(path), dtype="bfloat16", enable_prefix_caching=False,
                          max_model_len=prompt_len + decode + 8, max_num_seqs=1, **options)
                tps = _engine_decode(llm, _prompts(1, prompt_len, config["vocab_size"], 1), decode)
            rows[0][f"engine_tok_s_{key}"] = round(tps, 1)
            print(f"{preset} batch 1 {what}: {tps:.1f} tok/s", flush=True)
            del llm
            gc.collect()
            torch.cuda.empty_cache()
        if hf and not preset.endswith(FP8):
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device).eval()
            for row in rows:
                if row["batch"] > HF_MAX_BATCH:
                    continue
                try:
                    row["hf_tok_s"] = round(_hf_decode(model, _prompts(row["batch"], prompt_len, config["vocab_size"],
                                                                        row["batch"]), decode), 1)
                    row["engine_vs_hf"] = round(row["engine_tok_s"] / row["hf_tok_s"], 2)
                except Exception as exc:  # noqa: BLE001 - a failed reference is recorded, not fatal
                    row["hf_error"] = f"{type(exc).__name__}: {exc}"[:300]
                print(f"{preset} batch {row['batch']}: HF {row.get('hf_tok_s')}", flush=True)
            del model
            gc.collect()
            torch.cuda.empty_cache()
        bf16 = next((c for c in results if c["preset"] == preset.removesuffix(FP8)), None)
        if preset.endswith(FP8) and bf16 is not None:
            for row, base in zip(rows, bf16["rows"]):
                row["fp8_vs_bf16"] = round(row["engine_tok_s"] / base["engine_tok_s"], 3)
        results.append({"preset": preset, "weight_bytes": weight_bytes, "backends": backends, "rows": rows})
    return {"benchmark": "e2e_decode", "prompt_len": prompt_len, "decode_tokens": decode, "limits": limits,
            "cases": results}


if __name__ == "__main__":
    bench_main(partial(run, hf=os.environ.get("E2E_HF", "1") != "0", cases=_cases(os.environ.get("E2E_PRESETS"))),
               lambda result: [])
