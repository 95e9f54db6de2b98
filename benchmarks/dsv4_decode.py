"""DeepSeek-V4 at the V4-Flash layer shape on the engine as served, in the published FP8 + FP4 formats
and in bf16, beside HF transformers' deepseek_v4: decode step time and prefill tokens/s.

The layers are V4-Flash's: hidden 4096, 64 heads of 512 sharing one KV head, q_lora 1024, the
grouped output projection (8 groups of rank 1024), sliding window 128, CSA at rate 4 with its
lightning indexer (64 heads of 128 picking 512 entries), HCA at rate 128, 256 routed experts of
2048 (top-6) and one shared, mHC with 4 streams; in V4-Flash's order (two sliding layers, then CSA
and HCA alternating; the first three route by token hash, HF's default). One layer is 13 GB in
bf16, so there are only as many as fit on the card (while HF saves, which copies the experts' gate
and up weights, and while it measures) and, with the quantized copy, in the checkpoints' folder;
the JSON says how many. The vocabulary is 32K rather than 129,280, which shrinks the embedding and
the LM head only.

HF builds the model with its own random init on the device (the hash-routing tables drawn at
random: HF's zeros would send every token to one expert) and saves it as the bf16 checkpoint; HF is
measured on that model and freed. core/models/deepseek_v4/publish.py then writes the same weights
in the published layout (FP8 E4M3 with E8M0 128x128 block scales for the attention and shared
expert, packed FP4 E2M1 with an E8M0 per 32 for the routed experts), and each variant runs in
``LLM(dir)`` with its defaults: the backends the platform picks (Triton on CUDA), decode graphs,
prefix caching, prefill graphs. ``bf16_native`` (the torch oracle's backends, the baseline before
the fast path) and ``fp8_fp4_eager_prefill`` / ``bf16_eager_prefill`` (the same without prefill
graphs: their prefill rows against the graphed ones of the same run) run only when DSV4_VARIANTS
names them.

- Prefill: one prompt of each length, its time to the first token (after a warm-up prompt of the
  same length), as prompt tokens/s.
- Decode step at each batch and context: the time of 1 + n greedy tokens beyond that of one token,
  over n, on prompts the warm-up left in the prefix cache (a step whose prompts missed it is an
  error); HF's from ``model.generate`` (e2e_decode.py), where its attention over the context fits.
- Roofline: the bytes a step must read over the copy bandwidth measured in the same run: every
  weight as the engine holds it (its parameters, FP8/FP4 where kept so) except the embedding, the
  routed experts at the fraction a batch is expected to pick, and per sequence the window's KV,
  in CSA layers the indexer's keys (as the variant's cache keeps them: E4M3 and a scale beside the
  published FP8 weights) and the top-k entries, in HCA layers every entry (an open compression
  window's few projections are left out). Each row has its fraction of the roofline and
  engine/HF.

Every part records its error in the JSON instead of ending the run. Parts that would start past the
time budget are skipped, as are decode rows whose prefill (at the prefill rate just measured) would
end past it; the JSON says which and why. Environment: DSV4_LAYERS (layer count), DSV4_FIRST_LAYER
(start at V4-Flash's layer K: 2 is a CSA layer, so a short stack still compresses), DSV4_VARIANTS,
DSV4_BATCHES, DSV4_CONTEXTS, DSV4_PREFILLS (comma-separated), DSV4_HF=0 (no HF), DSV4_BUDGET_S,
DSV4_PROFILE=1 (each variant's kernels by device time in its shortest prefill and in a decode step
at the smallest and largest batch: where the step goes).

    python benchmarks/dsv4_decode.py --json benchmarks/results/dsv4-decode-h200.json
    bash benchmarks/device_run.sh dsv4_decode   # on the device: installs .whl/'s transformers first
"""

from __future__ import annotations

import gc
import os
import re
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from engine import LLM, SamplingParams
from engine.checkpoints.tokenizer import tokenizer_files
from engine.core.models.deepseek_v4.publish import write_published
from engine.core.models.weights import resident_bytes

try:
    from common import bench_main, device_kernels, kernels_beyond, measure_limits, timed
    from e2e_decode import _hf_decode, _prompts
except ImportError:
    from benchmarks.common import bench_main, device_kernels, kernels_beyond, measure_limits, timed
    from benchmarks.e2e_decode import _hf_decode, _prompts

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
FLASH = dict(vocab_size=32768, hidden_size=4096, num_attention_heads=64, num_key_value_heads=1, head_dim=512,
             q_lora_rank=1024, o_groups=8, o_lora_rank=1024, sliding_window=128, n_routed_experts=256,
             moe_intermediate_size=2048, num_experts_per_tok=6, n_shared_experts=1,
             compress_rates={CSA: 4, HCA: 128}, index_n_heads=64, index_head_dim=128, index_topk=512, hc_mult=4,
             max_position_embeddings=32768)  # V4-Flash: 1M; the engine caches RoPE that far
FLASH_DEPTH = 43
NATIVE = dict(v4_attention_backend="native", mhc_backend="native", moe_backend="native", linear_backend="native",
              norm_backend="native")


@dataclass(frozen=True)
class Variant:
    checkpoint: str  # "bf16" (as HF saves it) or "fp8_fp4" (the published layout)
    options: dict


NO_PREFILL_GRAPHS = dict(max_prefill_graph_tokens=0)
VARIANTS = {"fp8_fp4": Variant("fp8_fp4", {}), "bf16": Variant("bf16", {}), "bf16_native": Variant("bf16", NATIVE),
            "fp8_fp4_eager_prefill": Variant("fp8_fp4", NO_PREFILL_GRAPHS),
            "bf16_eager_prefill": Variant("bf16", NO_PREFILL_GRAPHS)}
DEFAULTS = {"DSV4_VARIANTS": "fp8_fp4,bf16", "DSV4_BATCHES": "1,8,32,128,256", "DSV4_CONTEXTS": "1024,16384",
            "DSV4_PREFILLS": "1024,4096,8192"}
HF_MAX_TOKENS = 32 * 1024  # batch x context: HF's eager attention holds [heads, context, context] scores
HF_MAX_CONTEXT = 8192  # per sequence and layer; at 16K that is 64 GiB in fp32
FP4_FRACTION, FP8_FRACTION = (0.5 + 1 / 32) / 2, 0.5  # quantized bytes over bf16's: routed experts, the rest
GPU_RESERVE = 40 * 2**30  # beside the weights: HF's attention over 32 x 1K tokens or 8K (~30 GiB), the pages
SAVE_RESERVE = 8 * 2**30
DISK_MARGIN = 2 * 2**30
SHM_MARGIN = 24 * 2**30  # /dev/shm is host memory, which the run needs some of too
BUDGET_S = 420  # a device call is at most 10 minutes; no part starts (or is expected to end) later
FIRST_LAYER = int(os.environ.get("DSV4_FIRST_LAYER", 0))


def env_list(name: str, env=os.environ, choices=None) -> list:
    """DSV4_* as a list: ints, or names from ``choices``; an unknown entry is an error naming the variable."""
    items = [s.strip() for s in env.get(name, DEFAULTS[name]).split(",") if s.strip()]
    if choices is not None:
        unknown = [s for s in items if s not in choices]
        if unknown:
            raise ValueError(f"{name}: unknown {unknown}; known: {', '.join(choices)}")
        return items
    if not all(s.isdigit() and int(s) > 0 for s in items):
        raise ValueError(f"{name} must be positive integers separated by commas, got {env[name]!r}")
    return [int(s) for s in items]


def greedy(tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, ignore_eos=True, max_tokens=tokens)


def decode_tokens(batch: int) -> int:
    return 16 if batch <= 8 else 8  # fewer where a step is long


def hf_skip_reason(batch: int, context: int) -> str | None:
    if context > HF_MAX_CONTEXT:
        return f"skipped: HF's eager attention at {context} tokens needs more than the card holds beside its weights"
    if batch * context > HF_MAX_TOKENS:
        return f"skipped: HF's attention over {batch} x {context} tokens needs more than the memory reserve"
    return None


def layer_types(n: int) -> list[str]:
    """V4-Flash's order (two sliding layers, then CSA and HCA alternating), from FIRST_LAYER on."""
    return ([SLIDING] * 2 + [CSA, HCA] * (n + FIRST_LAYER))[FIRST_LAYER:FIRST_LAYER + n]


# --- roofline: what a step reads ---

_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def resident_parts(named_parameters, n_routed: int, layers: int) -> dict:
    """Bytes the engine holds, split as a step reads them: per layer the routed experts (an expert
    stack's leading axis may hold the folded shared expert too, which every token reads) and the
    rest of the layer, the embedding (a step reads a row per token), and everything else."""
    parts = {"dense": [0] * layers, "experts": [0] * layers, "embedding": 0, "rest": 0}
    for name, p in named_parameters:
        size = p.numel() * p.element_size()
        if "embed" in name:
            parts["embedding"] += size
        elif m := _LAYER.match(name):
            i = int(m[1])
            routed = size * n_routed // p.shape[0] if ".ffn.experts." in name else 0
            parts["experts"][i] += routed
            parts["dense"][i] += size - routed
        else:
            parts["rest"] += size
    return parts


def kv_read_per_sequence(config: dict, context: int, dtype_bytes: int = 2, index_key_bytes: int | None = None) -> int:
    """Bytes of KV cache one sequence's decode step reads at ``context`` tokens, over all layers;
    ``index_key_bytes``: one indexer key as the cache keeps it (default: index_head_dim values)."""
    head = config["head_dim"]
    key = config["index_head_dim"] * dtype_bytes if index_key_bytes is None else index_key_bytes
    total = 0
    for kind in config["layer_types"]:
        total += min(context, config["sliding_window"]) * head * dtype_bytes
        if kind == CSA:
            entries = context // config["compress_rates"][CSA]
            total += entries * key + min(entries, config["index_topk"]) * head * dtype_bytes
        elif kind == HCA:
            total += context // config["compress_rates"][HCA] * head * dtype_bytes
    return total


def index_key_bytes(components) -> int | None:
    """Bytes of one indexer key (and its scale) in an engine's KV cache; None without a CSA layer."""
    layers = [layer.attn.cache.index_keys for layer in components.model.model.layers]
    index = next((i for i in layers if i is not None), None)
    return None if index is None else components.kv.specs[index].slot_bytes(components.kv.dtype)


def step_bytes(parts: dict, config: dict, batch: int, context: int, key_bytes: int | None = None) -> int:
    """Weights as resident (routed experts at the share a batch of ``batch`` tokens picks) plus the KV
    (indexer keys of ``key_bytes`` each, see kv_read_per_sequence)."""
    picked = 1 - (1 - config["num_experts_per_tok"] / config["n_routed_experts"]) ** batch
    weights = parts["rest"] + sum(parts["dense"]) + picked * sum(parts["experts"])
    return round(weights + batch * kv_read_per_sequence(config, context, index_key_bytes=key_bytes))


def roofline_ms(nbytes: int, copy_gb_s: float) -> float:
    return nbytes / (copy_gb_s * 1e9) * 1e3


# --- sizes and what fits ---

def _hf_config(shape: dict, layers: int):
    from transformers import DeepseekV4Config

    return DeepseekV4Config(**shape, num_hidden_layers=layers, layer_types=layer_types(layers))


def _nbytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in module.state_dict().values())


def _sizes(shape: dict) -> dict:
    """Bytes of each part at V4-Flash's depth in bf16, from HF's model on the meta device."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(_hf_config(shape, FLASH_DEPTH), dtype=torch.bfloat16)
    layers = [_nbytes(layer) for layer in model.model.layers]
    embedding = _nbytes(model.model.embed_tokens)
    return {"layers": layers, "routed_experts": [_nbytes(layer.mlp.experts) for layer in model.model.layers],
            "embedding": embedding, "rest": _nbytes(model) - sum(layers) - embedding}


def layers_within(sizes: dict, room: int, per_layer: list[int]) -> int:
    total, n = sizes["embedding"] + sizes["rest"], 0
    while n < len(per_layer) and total + per_layer[n] <= room:
        total += per_layer[n]
        n += 1
    return n


def folder_per_layer(sizes: dict, quantized: bool) -> list[int]:
    """Bytes each layer takes in the checkpoints' folder: bf16, plus the published copy where written."""
    if not quantized:
        return list(sizes["layers"])
    return [layer + experts * FP4_FRACTION + (layer - experts) * FP8_FRACTION
            for layer, experts in zip(sizes["layers"], sizes["routed_experts"])]


def _host_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def _folder(sizes: dict, per_layer: list[int]) -> tuple[Path, int]:
    """Where the checkpoints go and the bytes they may take: the temp folder's filesystem, or
    /dev/shm (host memory, faster to write and read) where as many layers fit."""
    tmp = Path(tempfile.gettempdir())
    options = [(tmp, shutil.disk_usage(tmp).free - DISK_MARGIN)]
    if Path("/dev/shm").is_dir():
        options.append((Path("/dev/shm"), min(shutil.disk_usage("/dev/shm").free, _host_available()) - SHM_MARGIN))
    return max(options, key=lambda o: (layers_within(sizes, o[1], per_layer), o[0] == Path("/dev/shm")))


def _fit(sizes: dict, device: torch.device, folder_room: int, per_layer: list[int]) -> dict:
    """Layers that fit: on the card while HF saves (its reverse conversion copies the experts' gate and
    up weights of every layer before it writes) and while it measures; in the checkpoints' folder."""
    free = torch.cuda.mem_get_info(device)[0]
    saving = [layer + experts for layer, experts in zip(sizes["layers"], sizes["routed_experts"])]
    return {"gpu_saving": layers_within(sizes, free - SAVE_RESERVE, saving),
            "gpu_measuring": layers_within(sizes, free - GPU_RESERVE, sizes["layers"]),
            "checkpoint_folder": layers_within(sizes, folder_room, per_layer)}


# --- running parts within the budget ---

class Budget:
    """Runs each part, recording its error or its skip instead of ending the run, and its seconds."""

    def __init__(self, result: dict, seconds: float) -> None:
        self.result, self.deadline = result, time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def attempt(self, part: str, fn, expected_s: float = 0.0):
        if self.left() < expected_s or self.left() <= 0:
            why = f" (about {expected_s:.0f} s expected, {max(self.left(), 0):.0f} s left)" if expected_s else ""
            self.result["errors"][part] = "skipped: past the time budget" + why
            return None
        start = time.monotonic()
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - a failed part is recorded; the others still run
            self.result["errors"][part] = f"{type(exc).__name__}: {exc}"[:400]
            print(f"{part} failed: {self.result['errors'][part]}", flush=True)
            return None
        finally:
            self.result["seconds"][part] = round(time.monotonic() - start, 1)
            _free()


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()




# --- the two sides: HF and the engine measure the same rows ---

def _engine_prefill(llm: LLM, length: int, vocab: int) -> float:
    """Prompt tokens/s of one prompt to its first token (a fresh prompt: no prefix hit)."""
    llm.generate(_prompts(1, length, vocab, length), greedy(1))  # warm-up: every kernel of this shape compiled
    return length / timed(lambda: llm.generate(_prompts(1, length, vocab, length + 1), greedy(1)))


def _hf_prefill(model, length: int, vocab: int) -> float:
    def run(seed: int):
        ids = torch.tensor(_prompts(1, length, vocab, seed), device=model.device)
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False, pad_token_id=0)

    run(length)
    return length / timed(lambda: run(length + 1))


def _engine_decode(llm: LLM, prompts: list[list[int]], n: int) -> float:
    """Decode tokens/s: (1 + n) tokens beyond one, the prompts in the prefix cache from the warm-up."""
    def run(tokens: int) -> float:
        outs = []
        seconds = timed(lambda: outs.extend(llm.generate(prompts, greedy(tokens))))
        missed = [len(p) - o.num_cached_tokens for p, o in zip(prompts, outs)]
        if max(missed) > llm.engine.config.page_size:
            raise RuntimeError(f"prompts missed the prefix cache ({max(missed)} tokens recomputed): "
                               f"the pages do not hold the batch")
        return seconds

    for _ in range(2):  # the first fills the prefix cache, the second compiles what a prefix hit launches
        llm.generate(prompts, greedy(1 + n))
    return len(prompts) * n / (run(1 + n) - run(1))


class Side:
    """One measured model (HF, or the engine on one variant): fills its columns of the rows."""

    def __init__(self, name: str, prefill, decode, skip=lambda batch, context: None, passes: int = 1) -> None:
        self.name, self.prefill, self.decode, self.skip = name, prefill, decode, skip  # skip: a reason or None
        self.passes = passes  # prefills of the prompts a decode row runs: 1 where the prefix cache holds them

    def measure(self, budget: Budget, rows: dict) -> None:
        rate, vocab = None, rows["config"]["vocab_size"]
        for length in rows["prefills"]:
            row = rows["prefill"].setdefault(length, {"prompt_len": length})
            if why := self.skip(1, length):
                budget.result["errors"][f"{self.name} prefill {length}"] = why
                continue
            tok_s = budget.attempt(f"{self.name} prefill {length}", lambda: self.prefill(length, vocab))
            if tok_s:
                rate = row[f"{self.name}_prefill_tok_s"] = round(tok_s, 1)
                print(f"{self.name} prefill {length}: {rate} tok/s", flush=True)
        for batch, context in rows["decode_cases"]:
            row, part = rows["decode"][batch, context], f"{self.name} decode {batch}x{context}"
            if why := self.skip(batch, context):
                budget.result["errors"][part] = why
                continue
            expected = self.passes * batch * context / rate if rate else 0.0
            tok_s = budget.attempt(part, lambda: self.decode(_prompts(batch, context, vocab, batch),
                                                             decode_tokens(batch)), expected)
            if tok_s:
                row[f"{self.name}_step_ms"] = round(1e3 * batch / tok_s, 3)
                print(f"{part}: step {row[f'{self.name}_step_ms']} ms", flush=True)


def _build_hf(shape: dict, layers: int, device: torch.device):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(_hf_config(shape, layers), dtype=torch.bfloat16).eval()
        for m in model.modules():
            if hasattr(m, "tid2eid"):  # [vocab, k]: k distinct experts per token id
                vocab, k = m.tid2eid.shape
                m.tid2eid.copy_(torch.rand(vocab, shape["n_routed_experts"]).argsort(-1)[:, :k])
    return model


def _save(model, path: Path, model_max_length: int) -> int:
    model.save_pretrained(path, max_shard_size="2GB")
    for name, text in tokenizer_files(model_max_length).items():
        (path / name).write_text(text)
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def _hf_side(budget: Budget, result: dict, rows: dict, shape: dict, layers: int, device: torch.device,
             path: Path, measure: bool) -> bool:
    """Builds HF's model, saves it to path as the bf16 checkpoint and measures it; True when saved."""
    model = budget.attempt("hf build", lambda: _build_hf(shape, layers, device))
    if model is None:
        return False
    saved = result["checkpoint_bytes"]["bf16"] = budget.attempt(
        "checkpoint save", lambda: _save(model, path, shape["max_position_embeddings"]))
    if measure:
        import transformers

        result["hf"] = {"transformers": transformers.__version__,
                        "attn_implementation": model.config._attn_implementation,
                        "experts_implementation": model.config._experts_implementation}
        Side("hf", partial(_hf_prefill, model), partial(_hf_decode, model), hf_skip_reason, passes=3).measure(
            budget, rows)
    return bool(saved)


def _engine_side(budget: Budget, result: dict, rows: dict, name: str, path: Path, profile: bool = False) -> None:
    """Loads the variant as served, records its resident bytes and backends, and measures it."""
    config, longest = rows["config"], max([c for _, c in rows["decode_cases"]] + rows["prefills"], default=1024)
    llm = budget.attempt(f"{name} load", lambda: LLM(
        str(path), progress=False, **VARIANTS[name].options, max_model_len=longest + 32,
        max_num_seqs=max([b for b, _ in rows["decode_cases"]], default=1)))
    if llm is None:
        return
    model = llm.engine.components.model
    held, weights = resident_bytes(model)
    parts = resident_parts(model.named_parameters(), config["n_routed_experts"], len(config["layer_types"]))
    key_bytes = index_key_bytes(llm.engine.components)
    result["variants"][name] = {
        "backends": {f: s.chosen.name for f, s in llm.engine.components.selections.items()},
        "resident_bytes": held, "parameters": weights, "bytes_per_parameter": round(held / weights, 4),
        "resident_parts": {k: v if isinstance(v, int) else sum(v) for k, v in parts.items()},
        "index_key_bytes": key_bytes}
    print(f"{name}: {held / weights:.3f} bytes per parameter resident", flush=True)
    copy = result["limits"].get("copy_gb_s")
    for (batch, context), row in rows["decode"].items():
        row["roofline"][name] = (round(roofline_ms(step_bytes(parts, config, batch, context, key_bytes), copy), 3)
                                 if copy else None)
    Side(name, partial(_engine_prefill, llm), partial(_engine_decode, llm)).measure(budget, rows)
    if profile:
        result["profiles"][name] = budget.attempt(f"{name} profile", lambda: _profile(llm, rows))
    del llm, model


def _profile(llm: LLM, rows: dict) -> dict:
    """Device kernels by name: of the shortest prefill (a fresh prompt), and of a decode step at the
    smallest and the largest batch of the shortest context (the kernels of 1 + n greedy tokens beyond
    those of one, over n, on prompts the measurement left in the prefix cache)."""
    vocab, out = rows["config"]["vocab_size"], {}
    seeds = iter(range(10**6, 10**7))
    for length in rows["prefills"][:1]:
        out[f"prefill {length}"] = device_kernels(
            lambda: llm.generate(_prompts(1, length, vocab, next(seeds)), greedy(1)), top=25)
    cases = [c for c in rows["decode_cases"] if c[1] == min(c[1] for c in rows["decode_cases"])]
    for batch, context in sorted({cases[0], cases[-1]}) if cases else []:
        prompts, n = _prompts(batch, context, vocab, batch), decode_tokens(batch)
        one, more = (device_kernels(lambda t=t: llm.generate(prompts, greedy(t)), top=None) for t in (1, 1 + n))
        step = kernels_beyond(more, one, n)
        out[f"decode {batch}x{context}"] = {**step, "top": step["top"][:25]}
    return out


def _rows(batches: list[int], contexts: list[int], prefills: list[int], config: dict) -> dict:
    """The rows every side fills, decode cases cheapest first (the budget skips the dearest)."""
    cases = sorted(((b, c) for c in contexts for b in batches), key=lambda case: (case[0] * case[1], case))
    return {"config": config, "prefills": sorted(prefills), "decode_cases": cases, "prefill": {},
            "decode": {(b, c): {"batch": b, "context": c, "decode_tokens": decode_tokens(b), "roofline": {}}
                       for b, c in cases}}


def summarize(rows: dict, variants: list[str]) -> dict:
    """The JSON's rows: per variant each figure, its fraction of the roofline, and engine/HF."""
    decode, prefill = [], []
    for row in rows["decode"].values():
        for name in variants:
            out = {"variant": name, **{k: row[k] for k in ("batch", "context", "decode_tokens")},
                   "step_ms": row.get(f"{name}_step_ms"), "hf_step_ms": row.get("hf_step_ms"),
                   "roofline_step_ms": row["roofline"].get(name)}
            if out["step_ms"] and out["roofline_step_ms"]:
                out["fraction_of_roofline"] = round(out["roofline_step_ms"] / out["step_ms"], 3)
            if out["step_ms"] and out["hf_step_ms"]:
                out["engine_vs_hf"] = round(out["hf_step_ms"] / out["step_ms"], 2)
            decode.append(out)
    for row in rows["prefill"].values():
        for name in variants:
            out = {"variant": name, "prompt_len": row["prompt_len"], "tok_s": row.get(f"{name}_prefill_tok_s"),
                   "hf_tok_s": row.get("hf_prefill_tok_s")}
            if out["tok_s"] and out["hf_tok_s"]:
                out["engine_vs_hf"] = round(out["tok_s"] / out["hf_tok_s"], 2)
            prefill.append(out)
    return {"decode": decode, "prefill": prefill}


class Stopped(BaseException):
    """A timeout's SIGTERM: not an Exception, so no part records it and carries on; the run writes
    what it has and removes the checkpoints."""


def _stop(*_) -> None:
    raise Stopped


def run(device: torch.device, limits: dict | None = None, shape: dict = FLASH, layers: int | None = None,
        env=os.environ) -> dict:
    """Prints each figure as it is measured; writing the checkpoints takes the longest."""
    variants = env_list("DSV4_VARIANTS", env, VARIANTS)
    batches, contexts, prefills = (env_list(k, env) for k in ("DSV4_BATCHES", "DSV4_CONTEXTS", "DSV4_PREFILLS"))
    with_hf, profile = env.get("DSV4_HF", "1") != "0", env.get("DSV4_PROFILE", "0") != "0"
    result = {"benchmark": "dsv4_decode", "variants": {}, "checkpoint_bytes": {}, "errors": {}, "seconds": {},
              "profiles": {}}
    budget = Budget(result, float(env.get("DSV4_BUDGET_S", BUDGET_S)))
    result["limits"] = limits if limits is not None else budget.attempt("limits", lambda: measure_limits(device)) or {}
    sizes = budget.attempt("sizes", lambda: _sizes(shape))
    if sizes is None:
        return result
    quantized = any(VARIANTS[v].checkpoint == "fp8_fp4" for v in variants)
    per_layer = folder_per_layer(sizes, quantized)
    folder, room = _folder(sizes, per_layer)
    if layers is None:
        result["layers_that_fit"] = _fit(sizes, device, room, per_layer)
        layers = min(result["layers_that_fit"].values())
    if layers < 1:
        result["errors"]["layers"] = "not one layer fits"
        return result
    print(f"{layers} layers ({', '.join(layer_types(layers))}), checkpoints in {folder}", flush=True)
    config = {**shape, "layer_types": layer_types(layers)}
    rows = _rows(batches, contexts, prefills, config)
    result.update(layers=layers, shape=config, checkpoint_folder=str(folder),
                  vocab_note=f"vocab {shape['vocab_size']} (V4-Flash: 129,280): only the embedding and LM head shrink")
    root = Path(tempfile.mkdtemp(prefix="engine-dsv4-", dir=folder))
    paths = {"bf16": root / "bf16", "fp8_fp4": root / "fp8_fp4"}
    previous = signal.signal(signal.SIGTERM, _stop)
    try:
        if _hf_side(budget, result, rows, shape, layers, device, paths["bf16"], with_hf):  # HF freed on return
            _free()
            if quantized:
                result["published"] = budget.attempt(
                    "write published layout", lambda: write_published(paths["bf16"], paths["fp8_fp4"], device))
            for name in variants:
                if VARIANTS[name].checkpoint == "bf16" or result.get("published"):
                    _engine_side(budget, result, rows, name, paths[VARIANTS[name].checkpoint], profile)
                    _free()  # the variant's engine, before the next one loads
    except Stopped:
        result["errors"]["run"] = "stopped by SIGTERM (the call's timeout): the figures measured before it"
    finally:
        signal.signal(signal.SIGTERM, previous)
        shutil.rmtree(root, ignore_errors=True)
        _free()
    result.update(summarize(rows, variants))
    return result


def _lines(result: dict) -> list[str]:
    variants = ", ".join(f"{n} {v['bytes_per_parameter']} B/param" for n, v in result.get("variants", {}).items())
    return ([f"resident: {variants}"] if variants else []) + \
        [f"{r['variant']} batch {r['batch']} at {r['context']}: {r['step_ms']} ms a step, HF {r['hf_step_ms']}, "
         f"roofline {r['roofline_step_ms']} ms" for r in result.get("decode", [])] + \
        [f"{r['variant']} prefill {r['prompt_len']}: {r['tok_s']} tok/s, HF {r['hf_tok_s']}"
         for r in result.get("prefill", [])] + \
        [f"{name} {case}: {p['per_run']:.0f} kernels, {p['device_ms_per_run']:.3f} ms; " + "; ".join(
            f"{k['kernel'][:40]} x{k['per_run']:.0f} {k['ms_per_run']:.3f}" for k in p["top"][:8])
         for name, cases in result.get("profiles", {}).items() for case, p in (cases or {}).items()] + \
        [f"{part}: {error}" for part, error in result["errors"].items()]


if __name__ == "__main__":
    bench_main(partial(run, layers=int(os.environ.get("DSV4_LAYERS", 0)) or None), _lines)
