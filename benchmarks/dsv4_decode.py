"""DeepSeek-V4 decode step time at the V4-Flash layer shape: the engine on its native (torch) backends,
the baseline its fused kernels will be measured against, beside HF transformers' deepseek_v4.

The layers are V4-Flash's: hidden 4096, 64 heads of 512 sharing one KV head, q_lora 1024, the
grouped output projection (8 groups of rank 1024), sliding window 128, CSA at rate 4 with its
lightning indexer (64 heads of 128 picking 512 entries), HCA at rate 128, 256 routed experts of
2048 (top-6) and one shared, mHC with 4 streams; in V4-Flash's order (two sliding layers, then CSA
and HCA alternating; the first three route by token hash, HF's default). One layer is 13 GB in
bf16, so there are only as many as fit both on the card (while HF saves, which copies the experts'
gate and up weights, and while its eager attention runs over 32 x 1K tokens) and where the
checkpoint is written; the JSON says how many. The vocabulary is 32K rather than 129,280, which
shrinks the embedding and the LM head only.

HF builds the model with its own random init on the device (the hash-routing tables drawn at
random: HF's zeros would send every token to one expert) and saves it once as the checkpoint both
sides run; HF is measured on that model and freed, then the engine loads the checkpoint. At batch 1
and 32 after 1K-token prompts, a decode step is the time of 1 + n greedy tokens beyond the time of
one token, over n (e2e_decode.py's helpers: ``LLM.generate`` with ignore_eos, HF ``model.generate``).
The roofline is what a step must read, at the measured copy bandwidth: each layer's dense weights,
the routed experts its batch is expected to pick, the LM head (the KV at 1K context is under 1% of
that). Every part records its error in the JSON instead of ending the run, and parts that would
start past the time budget are skipped. ``DSV4_LAYERS=N`` fixes the layer count, and
``DSV4_FIRST_LAYER=K`` starts at V4-Flash's layer K (2: a CSA layer, then HCA, ...) so that a
short stack still has compressed layers.

    python benchmarks/dsv4_decode.py --json benchmarks/results/dsv4-decode-h200.json
    bash benchmarks/device_run.sh dsv4_decode   # on the device: installs .whl/'s transformers first
"""

from __future__ import annotations

import gc
import os
import shutil
import signal
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

from engine import LLM
from engine.checkpoints.tokenizer import tokenizer_files

try:
    from common import bench_main, measure_limits
    from e2e_decode import _engine_decode, _hf_decode, _prompts
except ImportError:
    from benchmarks.common import bench_main, measure_limits
    from benchmarks.e2e_decode import _engine_decode, _hf_decode, _prompts

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
FLASH = dict(vocab_size=32768, hidden_size=4096, num_attention_heads=64, num_key_value_heads=1, head_dim=512,
             q_lora_rank=1024, o_groups=8, o_lora_rank=1024, sliding_window=128, n_routed_experts=256,
             moe_intermediate_size=2048, num_experts_per_tok=6, n_shared_experts=1,
             compress_rates={CSA: 4, HCA: 128}, index_n_heads=64, index_head_dim=128, index_topk=512, hc_mult=4,
             max_position_embeddings=4096)  # V4-Flash: 1M; the engine caches RoPE that far, positions past 1K never run
FLASH_DEPTH = 43
CASES = ((1, 16), (32, 8))  # (batch, decode tokens): fewer at 32, where a step that recomputes the context is slow
PROMPT_LEN = 1024
KV_CACHE_BYTES = 4 * 2**30  # the engine's pages: 32 x 1K tokens take under 1 GiB at 4 layers
GPU_RESERVE = 40 * 2**30  # beside the weights: HF's eager attention over 32 x 1K tokens (~30 GiB), the pages
SAVE_RESERVE = 8 * 2**30
DISK_MARGIN = 2 * 2**30
SHM_MARGIN = 24 * 2**30  # /dev/shm is host memory, which the run needs some of too
NATIVE = dict(attention_backend="native", moe_backend="native", linear_backend="native")  # the baseline
BUDGET_S = 300  # no part starts later, so the run ends within about 6 minutes
FIRST_LAYER = int(os.environ.get("DSV4_FIRST_LAYER", 0))


def layer_types(n: int) -> list[str]:
    """V4-Flash's order (two sliding layers, then CSA and HCA alternating), from FIRST_LAYER on."""
    return ([SLIDING] * 2 + [CSA, HCA] * (n + FIRST_LAYER))[FIRST_LAYER:FIRST_LAYER + n]


def _hf_config(shape: dict, layers: int):
    from transformers import DeepseekV4Config

    return DeepseekV4Config(**shape, num_hidden_layers=layers, layer_types=layer_types(layers))


def _nbytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in module.state_dict().values())


def _sizes(shape: dict) -> dict:
    """Bytes of each part at V4-Flash's depth, from HF's model on the meta device."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(_hf_config(shape, FLASH_DEPTH), dtype=torch.bfloat16)
    layers = [_nbytes(layer) for layer in model.model.layers]
    embedding = _nbytes(model.model.embed_tokens)
    return {"layers": layers, "routed_experts": [_nbytes(layer.mlp.experts) for layer in model.model.layers],
            "embedding": embedding, "rest": _nbytes(model) - sum(layers) - embedding}


def _host_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def _folder(sizes: dict) -> tuple[Path, int]:
    """Where the checkpoint goes and the bytes it may take: the temp folder's filesystem, or /dev/shm
    (host memory, faster to write and read) where as many layers fit."""
    tmp = Path(tempfile.gettempdir())
    options = [(tmp, shutil.disk_usage(tmp).free - DISK_MARGIN)]
    if Path("/dev/shm").is_dir():
        options.append((Path("/dev/shm"), min(shutil.disk_usage("/dev/shm").free, _host_available()) - SHM_MARGIN))
    return max(options, key=lambda option: (_layers_within(sizes, option[1]), option[0] == Path("/dev/shm")))


def _layers_within(sizes: dict, room: int, per_layer: list[int] | None = None) -> int:
    per_layer = per_layer or sizes["layers"]
    total, n = sizes["embedding"] + sizes["rest"], 0
    while n < len(per_layer) and total + per_layer[n] <= room:
        total += per_layer[n]
        n += 1
    return n


def _fit(sizes: dict, device: torch.device, folder_room: int) -> dict:
    """Layers that fit: on the card while HF saves (its reverse conversion copies the experts' gate and
    up weights of every layer before it writes) and while it measures; in the checkpoint's folder."""
    free = torch.cuda.mem_get_info(device)[0]
    saving = [layer + experts for layer, experts in zip(sizes["layers"], sizes["routed_experts"])]
    return {"gpu_saving": _layers_within(sizes, free - SAVE_RESERVE, saving),
            "gpu_measuring": _layers_within(sizes, free - GPU_RESERVE),
            "checkpoint_folder": _layers_within(sizes, folder_room)}


def _roofline_ms(sizes: dict, layers: int, batch: int, shape: dict, copy_gb_s: float) -> float:
    experts, k = shape["n_routed_experts"], shape["num_experts_per_tok"]
    unpicked = (1 - k / experts) ** batch  # each token picks k of the experts
    step = sizes["rest"] + sum(sizes["layers"][i] - sizes["routed_experts"][i] * unpicked for i in range(layers))
    return step / (copy_gb_s * 1e9) * 1e3


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


def _attempt(result: dict, deadline: float, part: str, fn):
    """fn()'s value, or None with its error (or its skip past the time budget) in result["errors"]."""
    if time.monotonic() > deadline:
        result["errors"][part] = "skipped: past the time budget"
        return None
    start = time.monotonic()
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - a failed part is recorded; the others still run
        result["errors"][part] = f"{type(exc).__name__}: {exc}"[:400]
        print(f"{part} failed: {result['errors'][part]}", flush=True)
        return None
    finally:
        result["seconds"][part] = round(time.monotonic() - start, 1)
        _free()


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def _measure(attempt, rows: list[dict], side: str, tok_s_of, vocab: int, prompt_len: int) -> None:
    for row in rows:
        b, n = row["batch"], row["decode_tokens"]
        tok_s = attempt(f"{side} batch {b}", lambda: tok_s_of(_prompts(b, prompt_len, vocab, b), n))
        if tok_s:
            row[f"{side}_step_ms"], row[f"{side}_tok_s"] = round(1e3 * b / tok_s, 2), round(tok_s, 1)
            print(f"{side} batch {b}: decode step {row[f'{side}_step_ms']} ms ({row[f'{side}_tok_s']} tok/s)",
                  flush=True)


def _hf_side(attempt, result: dict, shape: dict, layers: int, device: torch.device, root: Path,
             prompt_len: int) -> bool:
    """Builds HF's model, saves it to root as the checkpoint and measures it; True when the checkpoint is written."""
    model = attempt("hf build", lambda: _build_hf(shape, layers, device))
    if model is None:
        return False
    saved = result["checkpoint_bytes"] = attempt("checkpoint save",
                                                 lambda: _save(model, root, shape["max_position_embeddings"]))
    import transformers

    result["hf"] = {"transformers": transformers.__version__, "attn_implementation": model.config._attn_implementation,
                    "experts_implementation": model.config._experts_implementation}
    _measure(attempt, result["rows"], "hf", partial(_hf_decode, model), shape["vocab_size"], prompt_len)
    return bool(saved)


def _engine_side(attempt, result: dict, shape: dict, root: Path, prompt_len: int) -> None:
    rows = result["rows"]
    llm = attempt("engine load", lambda: LLM(
        str(root), dtype="bfloat16", enable_prefix_caching=False, kv_cache_memory=KV_CACHE_BYTES,
        **NATIVE,
        max_model_len=prompt_len + max(r["decode_tokens"] for r in rows) + 8,
        max_num_seqs=max(r["batch"] for r in rows)))
    if llm is not None:
        result["engine_backends"] = {f: s.chosen.name for f, s in llm.engine.components.selections.items()}
        _measure(attempt, rows, "engine", partial(_engine_decode, llm), shape["vocab_size"], prompt_len)


def run(device: torch.device, limits: dict | None = None, shape: dict = FLASH, cases=CASES,
        prompt_len: int = PROMPT_LEN, layers: int | None = None) -> dict:
    """Prints each figure as it is measured; writing the checkpoint takes the longest."""
    result = {"benchmark": "dsv4_decode", "prompt_len": prompt_len, "errors": {}, "seconds": {}}
    attempt = partial(_attempt, result, time.monotonic() + BUDGET_S)
    result["limits"] = limits if limits is not None else attempt("limits", lambda: measure_limits(device)) or {}
    sizes = attempt("sizes", lambda: _sizes(shape))
    if sizes is None:
        return result
    folder, room = _folder(sizes)
    if layers is None:
        result["layers_that_fit"] = _fit(sizes, device, room)
        layers = min(result["layers_that_fit"].values())
    if layers < 1:
        result["errors"]["layers"] = "not one layer fits"
        return result
    print(f"{layers} layers ({', '.join(layer_types(layers))}), checkpoint in {folder}", flush=True)
    copy = result["limits"].get("copy_gb_s")
    result.update(layers=layers, shape={**shape, "layer_types": layer_types(layers)}, checkpoint_folder=str(folder),
                  vocab_note=f"vocab {shape['vocab_size']} (V4-Flash: 129,280): only the embedding and LM head shrink",
                  rows=[{"batch": b, "decode_tokens": n, "roofline_step_ms":
                         round(_roofline_ms(sizes, layers, b, shape, copy), 3) if copy else None} for b, n in cases])
    root = Path(tempfile.mkdtemp(prefix="engine-dsv4-", dir=folder))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout's SIGTERM still removes the checkpoint
    try:
        if _hf_side(attempt, result, shape, layers, device, root, prompt_len):  # HF's model is freed on return
            _free()
            _engine_side(attempt, result, shape, root, prompt_len)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        _free()
    for row in result["rows"]:
        if row.get("engine_step_ms") and row.get("hf_step_ms"):
            row["engine_vs_hf"] = round(row["hf_step_ms"] / row["engine_step_ms"], 2)
    return result


def _lines(result: dict) -> list[str]:
    return [f"batch {r['batch']}: engine {r.get('engine_step_ms')} ms, HF {r.get('hf_step_ms')} ms, "
            f"roofline {r['roofline_step_ms']} ms per decode step" for r in result.get("rows", [])] + \
           [f"{part}: {error}" for part, error in result["errors"].items()]


if __name__ == "__main__":
    bench_main(partial(run, layers=int(os.environ.get("DSV4_LAYERS", 0)) or None), _lines)
