"""Command-line flags for an engine, turned into an ``EngineConfig``. Shared by every subcommand."""

from __future__ import annotations

import argparse
import dataclasses
import logging

from ..core import sizes
from ..core.config import (HICACHE_MEM_LAYOUTS, HICACHE_PREFETCH_POLICIES, HICACHE_WRITE_POLICIES, LOAD_BALANCE_METHODS,
                           EngineConfig)
from ..core.model_path import resolve_model
from ..core.spec.config import SpecConfigError, SpeculativeConfig

logger = logging.getLogger(__name__)


def parse_size(text: str) -> int:
    """A size flag's value in bytes (core/sizes.py), or the argument error that shows the forms."""
    try:
        return sizes.parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_speculative_config(text: str) -> SpeculativeConfig:
    """'{"method": "ngram", "num_speculative_tokens": 4}' -> its config, or the field at fault."""
    try:
        return SpeculativeConfig.of(text)
    except SpecConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="HF model directory; without it, the embedded default model (random weights)")
    g.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16 (auto: fp32 on CPU)")
    g.add_argument("--device", default=None, help="torch device; default: the detected platform's")
    g.add_argument("--seed", type=int, default=None,
                   help="seeds the engine's draws for requests that bring no seed of their own, so a run of the "
                        "same requests repeats (default: random); a request's own seed (`generate "
                        "--sampling-seed`, the API's `seed`) gives the same output whatever runs beside it")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output in tokens (default: the model's max_position_embeddings)")
    g.add_argument("--page-size", type=int, default=16, help="tokens per KV cache page")
    g.add_argument("--kv-cache-memory", type=parse_size, default=None,
                   help="bytes for KV pages (e.g. 4GiB); default: a fraction of free GPU memory, 2GiB on CPU")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.85,
                   help="fraction of the GPU's free memory (after the weights) the KV cache takes, when "
                        "--kv-cache-memory is not given")
    g.add_argument("--num-pages", type=int, default=None, help="exact KV page count (overrides the budget)")
    g.add_argument("--window-pages", type=int, default=None,
                   help="exact window page count (DeepSeek-V4's per-token components near each sequence's end)")
    g.add_argument("--max-num-seqs", type=int, default=256, help="sequences one step may run")
    g.add_argument("--max-num-batched-tokens", type=int, default=8192, help="tokens one step may run")
    g.add_argument("--chunked-prefill-size", type=int, default=2048, help="0 turns chunked prefill off")
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="never reuse the KV pages of a prompt prefix seen before")
    g.add_argument("--enforce-eager", action="store_true", help="never capture CUDA/HIP graphs")
    g.add_argument("--max-graph-batch", type=int, default=256, help="capture decode graphs up to this batch size")
    g.add_argument("--max-prefill-graph-tokens", type=int, default=8192,
                   help="capture prefill graphs for steps up to this many tokens (0: none)")
    g.add_argument("--graph-memory", type=parse_size, default=None,
                   help="bytes decode graphs, and prefill graphs, may each take (default: half of what the KV "
                        "cache leaves)")
    g.add_argument("--skip-warmup", dest="warmup", action="store_false", default=None,
                   help="serve without first running the step shapes a server meets (on a GPU the first "
                        "requests of each new shape then wait for their kernels to compile)")
    g.add_argument("--no-overlap-decode", dest="overlap_decode", action="store_false",
                   help="read every step's tokens before launching the next step")
    g.add_argument("--quantization", default=None, choices=["none"],
                   help="none: dequantize a quantized checkpoint's weights to --dtype at load (default: keep "
                        "them in their stored formats, FP8 / FP4, where the backends run them)")
    g.add_argument("--mxfp8-attention", action=argparse.BooleanOptionalAction, default=None,
                   help="DeepSeek-V4: quantize the attention output to MXFP8 in the attention kernel and run the "
                        "grouped output projection on it (default: on where the GPU multiplies MXFP8 natively, "
                        "sm_100 and gfx950; --no-mxfp8-attention keeps it in --dtype)")
    g.add_argument("--engram-placement", default="device", choices=["device", "host"],
                   help="where DeepSeek-V4.1's Engram tables live: device memory, or host memory (pinned on "
                        "CUDA) with each step's rows gathered there and copied while earlier layers compute")
    g.add_argument("--enable-swa-bounded-replay", action="store_true",
                   help="DeepSeek-V4.1: a prefill runs the decoder layers (those after the last KV source) only "
                        "over the last sliding_window prompt tokens; an approximation of a full prefill (README)")
    g.add_argument("--speculative-config", type=parse_speculative_config, default=None, metavar="JSON",
                   help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_min": 2, "prompt_lookup_max": 5}\' (methods: `engine plugins`, family spec)')
    g.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="processes (one per GPU) that split the model's weights, attention heads and KV cache")
    g.add_argument("--expert-parallel", action="store_true",
                   help="place whole MoE experts on the tensor-parallel ranks (all_to_all dispatch) instead of "
                        "splitting every expert over them")
    g.add_argument("--data-parallel-size", type=int, default=1,
                   help="with --enable-dp-attention: data-parallel attention ranks, dividing --tensor-parallel-size "
                        "(each rank's attention tensor-parallel over the quotient of processes)")
    g.add_argument("--enable-dp-attention", action="store_true",
                   help="attention and its KV cache data-parallel (each rank its own requests), the MoE layers "
                        "over every rank (DeepSeek-V4, Qwen3-MoE)")
    g.add_argument("--load-balance-method", choices=LOAD_BALANCE_METHODS, default="prefix",
                   help="with --enable-dp-attention: the rank a new request goes to: the one caching its longest "
                        "prefix (prefix), the one with the fewest outstanding requests (shortest_queue), or each in "
                        "turn (round_robin)")
    g.add_argument("--load-balance-threshold", type=int, default=4,
                   help="with --load-balance-method prefix: ranks with more than this many outstanding requests "
                        "above the least loaded one's are passed over")
    g.add_argument("--cpu-threads", type=int, default=None,
                   help="torch CPU threads of the engine (default: serve: the cores the process may use less one, "
                        "left to the API process; generate and bench: torch's choice)")
    g.add_argument("--distributed-timeout", type=float, default=300.0,
                   help="seconds a collective or a rank's start-up may take before the engine fails")
    defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    g.add_argument("--grammar-compile-timeout", type=float, default=defaults["grammar_compile_timeout"],
                   help="seconds a structured-output grammar may take to compile; longer is a 400 (default %(default)s)")
    g.add_argument("--grammar-cache-memory", type=parse_size, default="256MiB",
                   help="bytes of compiled grammars kept for reuse, least recently used dropped (default %(default)s)")
    h = p.add_argument_group("hierarchical KV cache (the prefix cache's pages kept in host memory too)")
    h.add_argument("--enable-hierarchical-cache", action="store_true", help="keep the prefix cache's pages in host "
                   "memory too, and bring them back to the device when a prompt matches")
    h.add_argument("--hicache-ratio", type=float, default=2.0,
                   help="host memory records per device KV page (and window page)")
    h.add_argument("--hicache-size", type=float, default=0.0, metavar="GiB",
                   help="host memory for them in GiB, instead of --hicache-ratio (0: by the ratio)")
    h.add_argument("--hicache-write-policy", default="write_through", choices=HICACHE_WRITE_POLICIES,
                   help="when pages go to host memory: as cached, once matched twice, or when evicted")
    h.add_argument("--hicache-mem-layout", default="layer_first", choices=HICACHE_MEM_LAYOUTS,
                   help="host arrays per KV component (layer_first) or one row per page (page_first)")
    h.add_argument("--hicache-storage-backend", default=None,
                   help="a storage tier below host memory (L3): file, or a plugin's (`engine plugins`, family cache_tier)")
    h.add_argument("--hicache-storage-dir", default=None, help="the file backend's directory (engines may share it)")
    h.add_argument("--hicache-storage-max-size", type=float, default=0.0,
                   help="GiB the file backend's directory may hold: least recently used records are deleted "
                        "past it (0: no bound)")
    h.add_argument("--hicache-storage-prefetch-policy", default="best_effort", choices=HICACHE_PREFETCH_POLICIES,
                   help="how long a request waits for its prefix to arrive from storage: not at all (best_effort), "
                        "until all of it has (wait_complete), or a bound of 1 s + 0.25 s per 1K tokens (timeout)")
    h.add_argument("--hicache-storage-prefetch-threshold", type=int, default=256,
                   help="tokens a storage hit must reach to be fetched")
    for family in ("attention", "v4-attention", "mhc", "moe", "linear", "norm", "sampling", "graph"):
        g.add_argument(f"--{family}-backend", default=None, help=f"name a {family} backend (see `engine plugins`)")


def model_dir(args: argparse.Namespace) -> str:
    """The --model directory (a hub id resolved from the local Hugging Face cache), or the embedded
    default written on first use; a model that is neither ends the command with one line saying why."""
    if args.model:
        try:
            return resolve_model(args.model)
        except FileNotFoundError as exc:
            raise SystemExit(f"engine: error: {exc}") from None
    from ..checkpoints import ensure_default_model

    path = ensure_default_model()
    print(f"[engine] no --model given: using the embedded default model at {path}. "
          "It has RANDOM weights and its output is meaningless text.", flush=True)
    return str(path)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=model_dir(args), dtype=args.dtype, device=args.device, seed=args.seed,
        max_model_len=args.max_model_len, page_size=args.page_size, kv_cache_memory=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization, num_pages=args.num_pages,
        window_pages=args.window_pages,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        chunked_prefill_size=args.chunked_prefill_size or None, enable_prefix_caching=args.enable_prefix_caching,
        attention_backend=args.attention_backend, v4_attention_backend=args.v4_attention_backend,
        mhc_backend=args.mhc_backend, moe_backend=args.moe_backend,
        linear_backend=args.linear_backend, norm_backend=args.norm_backend, sampling_backend=args.sampling_backend,
        graph_backend=args.graph_backend, enforce_eager=args.enforce_eager,
        max_graph_batch=args.max_graph_batch, max_prefill_graph_tokens=args.max_prefill_graph_tokens,
        graph_memory=args.graph_memory, overlap_decode=args.overlap_decode,
        warmup=args.warmup,
        quantization=args.quantization, mxfp8_attention=args.mxfp8_attention,
        engram_placement=args.engram_placement, enable_swa_bounded_replay=args.enable_swa_bounded_replay,
        speculative_config=args.speculative_config,
        tensor_parallel_size=args.tensor_parallel_size, expert_parallel=args.expert_parallel,
        data_parallel_size=args.data_parallel_size, enable_dp_attention=args.enable_dp_attention,
        load_balance_method=args.load_balance_method, load_balance_threshold=args.load_balance_threshold,
        distributed_timeout=args.distributed_timeout, cpu_threads=args.cpu_threads,
        grammar_compile_timeout=args.grammar_compile_timeout, grammar_cache_memory=args.grammar_cache_memory,
        enable_hierarchical_cache=args.enable_hierarchical_cache, hicache_ratio=args.hicache_ratio,
        hicache_size=args.hicache_size, hicache_write_policy=args.hicache_write_policy,
        hicache_mem_layout=args.hicache_mem_layout, hicache_storage_backend=args.hicache_storage_backend,
        hicache_storage_dir=args.hicache_storage_dir, hicache_storage_max_size=args.hicache_storage_max_size,
        hicache_storage_prefetch_policy=args.hicache_storage_prefetch_policy,
        hicache_storage_prefetch_threshold=args.hicache_storage_prefetch_threshold,
    )
