"""DeepSeek-V4.1's Engram tables in host memory against on the device: decode step time at batch 1
and 32, with the rows prefetched (copied on a side stream while the layers before each Engram
layer compute) and without (copied before the step's first layer).

The Engram layers are V4.1-Flash's per token: layers 1 and 14, n-grams of order 2..4, 8 heads, rows
of 256, so a token reads 24 rows a layer; the tables have 24 prime-sized ranges from
``engram_vocab_size`` each, as V4.1-Flash's do, but fewer rows (ENGRAM_VOCAB, default 2^19: about
12.6M rows, 6.4 GB in bf16 a layer, against Flash's 384M rows, 98 GB in FP8), so that both
placements fit the card and the host; the JSON says how many rows. Around them a 16-layer random V4
stack (hidden 1024, V4's sliding, CSA and HCA layers, no CSA2, so the Triton V4 attention and decode
graphs run; 16 experts of 512, top 4).

Variants, each ``LLM(dir)`` with its defaults but the placement: ``device``; ``device_no_overlap``
(the engine loop host placement runs: every step's tokens read before the next is launched);
``host`` (prefetch); ``host_no_prefetch``. The decode step: the time of 1 + n greedy tokens beyond
that of one token, over n, on prompts of 256 tokens the warm-up left in the prefix cache. The goal
(issue 21): ``host`` within 3% of ``device`` at batch 32.

    python benchmarks/engram_placement.py --json benchmarks/results/engram-placement-h200.json
"""

from __future__ import annotations

import gc
import json
import os
import random
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine import LLM, SamplingParams
from engine.checkpoints.tokenizer import TOKENIZER_SIZE, tokenizer_files
from engine.core.config import EngineConfig, ModelConfig
from engine.core.models.base import Backends
from engine.core.models.deepseek_v4.engram import EngramLayout
from engine.core.models.deepseek_v4.model import DeepseekV4ForCausalLM
from engine.core.models.deepseek_v4.publish import unstacked_experts
from engine.core.plugins import load_plugins
from engine.core.registry import SelectionContext
from engine.core.startup import model_families, select_backends

try:
    from common import bench_main, timed
except ImportError:  # imported as benchmarks.engram_placement
    from benchmarks.common import bench_main, timed

FLASH_ENGRAM_ROWS = 384006168 + 384016682  # V4.1-Flash's engram_num_embeddings
ENGRAM = {"engram_layer_ids": [1, 14], "engram_max_ngram_size": 4, "engram_n_heads": 8, "engram_head_dim": 256,
          "engram_pad_token_id": 2}  # V4.1-Flash's
STACK = {"hidden_size": 1024, "num_hidden_layers": 16, "num_attention_heads": 8, "head_dim": 512,
         "qk_rope_head_dim": 64, "q_lora_rank": 512, "o_groups": 2, "o_lora_rank": 256, "n_routed_experts": 16,
         "num_experts_per_tok": 4, "moe_intermediate_size": 512, "index_n_heads": 16, "index_head_dim": 128,
         "index_topk": 64, "sliding_window": 128, "hc_mult": 4}
VARIANTS = {"device": {}, "device_no_overlap": {"overlap_decode": False}, "host": {"engram_placement": "host"},
            "host_no_prefetch": {"engram_placement": "host"}}


def config(stack: dict, engram_vocab: int) -> dict:
    """config.json of the random V4.1: ``stack``'s layer shape, V4's ratios (two sliding layers, then CSA and
    HCA alternating), Flash's Engram layers (those past the stack dropped) over ``engram_vocab``."""
    n = stack["num_hidden_layers"]
    return {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "dtype": "bfloat16",
        "vocab_size": TOKENIZER_SIZE, "n_shared_experts": 1, "num_hash_layers": 1, "scoring_func": "sqrtsoftplus",
        "routed_scaling_factor": 1.5, "norm_topk_prob": True, "swiglu_limit": 10.0, "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
        "max_position_embeddings": 4096, "num_key_value_heads": 1, "num_nextn_predict_layers": 0,
        "compress_ratios": [0, 0] + [4 if i % 2 == 0 else 128 for i in range(n - 2)], **stack, **ENGRAM,
        "engram_layer_ids": [i for i in ENGRAM["engram_layer_ids"] if i < n], "engram_vocab_size": engram_vocab,
    }


def write_checkpoint(path: Path, hf: dict, device: torch.device) -> int:
    """``hf`` with random weights (shapes from the model built on the meta device, drawn on ``device``:
    a GPU draws the tables' billions in seconds) under ``path``, the Engram tables each in a file of
    its own; returns the tables' rows."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf))
    for name, text in tokenizer_files(hf["max_position_embeddings"]).items():
        (path / name).write_text(text)
    model_config = ModelConfig.from_dir(path, "bfloat16", "cpu")
    plugins = load_plugins()
    ctx = SelectionContext(platform=plugins.detect_platform(), model_config=model_config,
                           engine_config=EngineConfig(model=str(path), device="cpu", dtype="bfloat16"))
    selections = select_backends(plugins, ctx, ctx.engine_config, model_families(DeepseekV4ForCausalLM))
    model = DeepseekV4ForCausalLM(model_config, Backends(**{f: s.create(ctx) for f, s in selections.items()}),
                                  device="meta")
    gen = torch.Generator(device).manual_seed(0)
    rest, rows = {}, 0
    for name, t in model.state_dict().items():
        if name.endswith("tid2eid"):
            w = torch.stack([torch.randperm(hf["n_routed_experts"], generator=gen, device=device)
                             [:hf["num_experts_per_tok"]] for _ in range(t.shape[0])]).to(t.dtype)
        elif "norm" in name or name.endswith(("scale", "q_weight", "k_weight")):
            w = (torch.rand(t.shape, generator=gen, device=device) + 0.5).to(t.dtype)
        else:
            w = (torch.randn(t.shape, generator=gen, device=device) * 0.02).to(t.dtype)
        w = w.cpu()
        if name.endswith("engram.embed.weight"):
            rows += t.shape[0]
            save_file({name: w}, str(path / f"{name}.safetensors"))
        else:
            rest[name] = w
    save_file(dict(unstacked_experts(rest, hf["n_routed_experts"])), str(path / "model.safetensors"))
    return rows






def step_ms(llm: LLM, prompts: list[list[int]], n: int) -> float:
    """A decode step's ms: (1 + n) greedy tokens beyond one, over n, the prompts in the prefix cache."""
    def run(tokens: int) -> float:
        return timed(lambda: llm.generate(prompts, SamplingParams(temperature=0, ignore_eos=True, max_tokens=tokens)))

    run(1 + n)  # warm-up: the prompts into the prefix cache, every shape met
    return 1e3 * (run(1 + n) - run(1)) / n


def run(device: torch.device, stack: dict = STACK, engram_vocab: int | None = None, batches: tuple = (1, 32),
        tokens: int = 32, prompt_len: int = 256, variants: tuple = tuple(VARIANTS)) -> dict:
    engram_vocab = engram_vocab or int(os.environ.get("ENGRAM_VOCAB", 2**19))
    rng = random.Random(0)
    rows_out: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "v41"
        hf = config(stack, engram_vocab)
        started = time.monotonic()
        rows = write_checkpoint(path, hf, device)
        layout = EngramLayout.from_config(hf, path)
        result = {"engram_rows": rows, "flash_engram_rows": FLASH_ENGRAM_ROWS,
                  "engram_table_gb_bf16": round(rows * layout.head_dim * 2 / 1e9, 2),
                  "rows_per_token_per_layer": (layout.order - 1) * layout.heads, "engram_layers": sorted(layout.layers),
                  "stack": stack, "prompt_len": prompt_len, "tokens": tokens,
                  "checkpoint_s": round(time.monotonic() - started, 1)}
        prompts = {b: [[rng.randrange(5, TOKENIZER_SIZE) for _ in range(prompt_len)] for _ in range(b)]
                   for b in batches}
        for name in variants:
            llm = LLM(str(path), device=device.type, dtype="bfloat16", progress=False, max_num_seqs=max(batches),
                      **VARIANTS[name])
            if name == "host_no_prefetch":
                llm.engine.components.model.host_engram.prefetch = False
            graphs = llm.engine.components.graphs
            for b in batches:
                rows_out.append({"variant": name, "batch": b, "step_ms": round(step_ms(llm, prompts[b], tokens), 4),
                                 "graphs": graphs is not None and graphs.buckets[-1] >= b})
            del llm
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    base = {(r["batch"]): r["step_ms"] for r in rows_out if r["variant"] == "device"}
    for r in rows_out:
        if base.get(r["batch"], 0) > 0:
            r["vs_device"] = round(r["step_ms"] / base[r["batch"]], 4)
    return result | {"decode": rows_out}


def _lines(result: dict) -> list[str]:
    return [f"Engram tables: {result['engram_rows']} rows ({result['engram_table_gb_bf16']} GB bf16; V4.1-Flash "
            f"{result['flash_engram_rows']}), {result['rows_per_token_per_layer']} rows a token at layers "
            f"{result['engram_layers']}"] + \
        [f"{r['variant']} batch {r['batch']}: {r['step_ms']} ms a step, x{r.get('vs_device')} of device"
         f"{'' if r['graphs'] else ' (eager)'}" for r in result["decode"]]


if __name__ == "__main__":
    bench_main(partial(run), _lines)
