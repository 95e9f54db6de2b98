"""Typed configuration: the model as its directory describes it, and the engine's own knobs."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .model_path import cached_snapshot, missing_model
from .sizes import parse_size
from .disagg.config import DisaggConfig
from .distributed.dp_router import METHODS as LOAD_BALANCE_METHODS
from .spec.config import SpecConfigError, SpeculativeConfig

if TYPE_CHECKING:
    import torch

# dtype names -> torch's attribute names (torch is imported where a dtype is made, so that the
# command line's help and argument errors never wait for it)
DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}


QUANTIZATIONS = (None, "none")  # None: as the checkpoint stores the weights
ENGRAM_PLACEMENTS = ("device", "host")  # where DeepSeek-V4.1's Engram tables live (core/models/deepseek_v4/engram_host.py)
HICACHE_WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
HICACHE_MEM_LAYOUTS = ("layer_first", "page_first")
HICACHE_PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    import torch

    if isinstance(name, torch.dtype):
        return name
    try:
        return getattr(torch, DTYPES[name.lower()])
    except KeyError:
        raise ValueError(f"dtype must be one of auto, {', '.join(sorted(DTYPES))}; got {name!r}") from None


@dataclass(frozen=True)
class ModelConfig:
    """A model directory's config.json, with the few fields the engine itself needs lifted out."""

    path: Path
    hf: dict[str, Any]
    architecture: str
    dtype: torch.dtype
    max_model_len: int
    vocab_size: int
    quantization: str | None = None  # EngineConfig.quantization
    engram_placement: str = "device"  # EngineConfig.engram_placement
    swa_bounded_replay: bool = False  # EngineConfig.enable_swa_bounded_replay

    @classmethod
    def from_dir(cls, path: str | Path, dtype: str | torch.dtype = "auto", device: str = "cpu",
                 max_model_len: int | None = None, quantization: str | None = None,
                 engram_placement: str = "device", swa_bounded_replay: bool = False) -> "ModelConfig":
        path = Path(path).expanduser()
        config_file = path / "config.json"
        if not path.is_dir():
            raise FileNotFoundError(missing_model(str(path)))
        if not config_file.is_file():
            raise FileNotFoundError(f"{config_file} is missing: a model directory needs config.json")
        hf = json.loads(config_file.read_text())
        archs = hf.get("architectures") or []
        if not archs:
            raise ValueError(f"{config_file} names no architectures")
        if dtype == "auto":
            # bf16 matmuls are slow on most CPUs and fp16 is incomplete there: fp32 on the host.
            name = "float32" if device == "cpu" else hf.get("dtype") or hf.get("torch_dtype") or "bfloat16"
            resolved = parse_dtype(name)
        else:
            resolved = parse_dtype(dtype)
        limit = int(hf.get("max_position_embeddings") or 4096)
        if max_model_len is not None and max_model_len > limit:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's max_position_embeddings {limit}")
        return cls(path, hf, archs[0], resolved, int(max_model_len or limit), int(hf["vocab_size"]), quantization,
                   engram_placement, swa_bounded_replay)

    def get(self, key: str, default: Any = None) -> Any:
        return self.hf.get(key, default)


@dataclass(frozen=True)
class EngineConfig:
    """Everything that shapes one engine instance. Validated once; frozen afterwards."""

    model: str
    dtype: str = "auto"
    device: str | None = None  # None: the detected platform's device
    seed: int | None = None  # seeds draws of requests without a seed of their own; None: random
    max_model_len: int | None = None
    page_size: int = 16
    # sizes in bytes, or as strings such as "4GiB" or "512MB" (core/sizes.py)
    kv_cache_memory: int | str | None = None  # bytes for KV pages; None: a fraction of free device memory
    gpu_memory_utilization: float = 0.85
    cpu_kv_cache_memory: int | str = 2 * 2**30  # the default budget on the host, where free memory is shared
    num_pages: int | None = None  # an exact page count overrides the memory budget (tests, benchmarks)
    window_pages: int | None = None  # an exact window page count (models with windowed KV, core/kv/window.py)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192  # per-step token budget
    chunked_prefill_size: int | None = 2048  # None or 0: prompts are never split
    enable_prefix_caching: bool = True
    attention_backend: str | None = None
    v4_attention_backend: str | None = None
    mhc_backend: str | None = None
    moe_backend: str | None = None
    linear_backend: str | None = None
    norm_backend: str | None = None
    sampling_backend: str | None = None
    graph_backend: str | None = None
    enforce_eager: bool = False  # never capture graphs, even where a graphs backend could
    max_graph_batch: int = 256  # decode graphs are captured for batch sizes up to this (and max_num_seqs)
    # prefill graphs (core/prefill_graphs.py) are captured for steps of up to this many tokens (and
    # max_num_batched_tokens, max_model_len); 0: none
    max_prefill_graph_tokens: int = 8192
    graph_memory: int | str | None = None  # bytes decode and prefill graphs may each take; None: half of what the KV cache leaves
    # run the step shapes a server meets once at start-up, so no request waits for a kernel to
    # compile (core/warmup.py); None: where kernels compile just in time (CUDA and HIP devices)
    warmup: bool | None = None
    overlap_decode: bool = True  # launch each step before the last one's tokens reach the host (core/engine.py)
    # None: quantized checkpoint weights stay in their stored formats where the backends run them;
    # "none": dequantized to dtype at load
    quantization: str | None = None
    # DeepSeek-V4's attention output quantized to MXFP8 in the attention's epilogue, and the grouped
    # output projection (wo_a) run on MXFP8 operands; None: where the platform multiplies MXFP8
    # natively (sm_100, gfx950) and the V4 attention backend can (core/families/v4_attention.py)
    mxfp8_attention: bool | None = None
    # DeepSeek-V4.1's Engram tables: "device" memory, or "host" memory (pinned on CUDA), the rows each
    # step needs gathered there and copied to the device while the layers before them compute
    engram_placement: str = "device"
    # DeepSeek-V4.1's encoder/decoder split (core/models/deepseek_v4/replay.py): a prefill runs the
    # decoder layers only over the last sliding_window tokens of its prompt, an approximation
    enable_swa_bounded_replay: bool = False
    # the hierarchical KV cache (core/kv/hierarchy.py): the prefix cache's pages kept in host memory too
    enable_hierarchical_cache: bool = False
    hicache_ratio: float = 2.0  # host records per device page (and window page)
    hicache_size: float = 0.0  # GiB of host memory for them; 0: by hicache_ratio
    hicache_write_policy: str = "write_through"  # write_through | write_through_selective | write_back
    hicache_mem_layout: str = "layer_first"  # layer_first | page_first
    hicache_storage_backend: str | None = None  # L3: a cache-tier name (file, or a plugin's)
    hicache_storage_dir: str | None = None  # the file backend's directory (shared by engines)
    hicache_storage_max_size: float = 0.0  # GiB the file backend's directory may hold (LRU records go); 0: no bound
    hicache_storage_prefetch_policy: str = "best_effort"  # best_effort | wait_complete | timeout
    hicache_storage_prefetch_threshold: int = 256  # tokens a storage hit must reach to be fetched
    # speculative decoding (core/spec/): a SpeculativeConfig, or its fields as a mapping or a JSON object
    speculative_config: SpeculativeConfig | None = None
    # processes that split the model's weights and KV heads (core/distributed): rank 0 is this engine
    tensor_parallel_size: int = 1
    expert_parallel: bool = False  # MoE experts partitioned over those processes (all_to_all), not split
    # data-parallel attention (core/distributed/dp_attention.py): each of data_parallel_size ranks runs its
    # own requests through attention (tensor-parallel over tensor_parallel_size / data_parallel_size
    # processes) with its own KV cache and scheduler; the MoE layers span every process
    data_parallel_size: int = 1
    enable_dp_attention: bool = False
    # which rank a new request goes to (core/distributed/dp_router.py): prefix | shortest_queue | round_robin;
    # prefix passes over ranks with more than load_balance_threshold requests above the least loaded one's
    load_balance_method: str = "prefix"
    load_balance_threshold: int = 4
    distributed_timeout: float = 300.0  # seconds a collective or a rank's start-up may take before the engine fails
    # prefill/decode disaggregation (core/disagg/): a DisaggConfig or its fields as a mapping; None: neither
    disaggregation: DisaggConfig | None = None
    # structured outputs (core/structured/): a grammar must compile within this many seconds, and the
    # compiled grammars kept for reuse take at most this many bytes
    grammar_compile_timeout: float = 10.0
    grammar_cache_memory: int | str = 256 * 2**20
    # torch's CPU threads in the engine; None: torch's own choice (`engine serve` passes the cores its
    # engine process may use, less one for the API process: core/threads.py)
    cpu_threads: int | None = None
    plugin_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not Path(self.model).expanduser().exists() and (snapshot := cached_snapshot(self.model)):
            object.__setattr__(self, "model", snapshot)  # a hub id in the local Hugging Face cache
        for name in ("kv_cache_memory", "cpu_kv_cache_memory", "graph_memory", "grammar_cache_memory"):
            value = getattr(self, name)
            if value is not None:
                try:
                    object.__setattr__(self, name, parse_size(value))
                except ValueError as exc:
                    raise ValueError(f"{name}: {exc}") from None
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.chunked_prefill_size is not None and self.chunked_prefill_size < 0:
            raise ValueError(f"chunked_prefill_size must be >= 0, got {self.chunked_prefill_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0, got {self.kv_cache_memory}")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"cpu_threads must be >= 1, got {self.cpu_threads}")
        if self.max_graph_batch < 1:
            raise ValueError(f"max_graph_batch must be >= 1, got {self.max_graph_batch}")
        if self.max_prefill_graph_tokens < 0:
            raise ValueError(f"max_prefill_graph_tokens must be >= 0, got {self.max_prefill_graph_tokens}")
        if self.num_pages is not None and self.num_pages < 2:
            raise ValueError(f"num_pages must be >= 2, got {self.num_pages}")
        if self.window_pages is not None and self.window_pages < 2:
            raise ValueError(f"window_pages must be >= 2, got {self.window_pages}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.data_parallel_size > 1 or self.enable_dp_attention:
            self._check_dp_attention()
        if self.load_balance_method not in LOAD_BALANCE_METHODS:
            raise ValueError(f"load_balance_method must be one of {', '.join(LOAD_BALANCE_METHODS)}, got "
                             f"{self.load_balance_method!r}")
        if self.load_balance_threshold < 0:
            raise ValueError(f"load_balance_threshold must be >= 0, got {self.load_balance_threshold}")
        if self.distributed_timeout <= 0:
            raise ValueError(f"distributed_timeout must be > 0, got {self.distributed_timeout}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.engram_placement not in ENGRAM_PLACEMENTS:
            raise ValueError(f"engram_placement must be one of {', '.join(ENGRAM_PLACEMENTS)}, "
                             f"got {self.engram_placement!r}")
        if self.disaggregation is not None:
            object.__setattr__(self, "disaggregation", DisaggConfig.of(self.disaggregation))
            if self.tensor_parallel_size > 1:
                raise ValueError("prefill/decode disaggregation moves one process's KV pages: tensor_parallel_size "
                                 f"must be 1, got {self.tensor_parallel_size}")
        if not self.grammar_compile_timeout > 0:
            raise ValueError(f"grammar_compile_timeout must be > 0, got {self.grammar_compile_timeout}")
        if self.hicache_write_policy not in HICACHE_WRITE_POLICIES:
            raise ValueError(f"hicache_write_policy must be one of {', '.join(HICACHE_WRITE_POLICIES)}, "
                             f"got {self.hicache_write_policy!r}")
        if self.hicache_mem_layout not in HICACHE_MEM_LAYOUTS:
            raise ValueError(f"hicache_mem_layout must be one of {', '.join(HICACHE_MEM_LAYOUTS)}, "
                             f"got {self.hicache_mem_layout!r}")
        if self.hicache_ratio <= 0 or self.hicache_size < 0:
            raise ValueError(f"hicache_ratio must be > 0 and hicache_size >= 0, got {self.hicache_ratio} "
                             f"and {self.hicache_size}")
        if self.hicache_storage_max_size < 0:
            raise ValueError(f"hicache_storage_max_size must be >= 0 (GiB; 0: no bound), "
                             f"got {self.hicache_storage_max_size}")
        if self.hicache_storage_prefetch_policy not in HICACHE_PREFETCH_POLICIES:
            raise ValueError(f"hicache_storage_prefetch_policy must be one of {', '.join(HICACHE_PREFETCH_POLICIES)}, "
                             f"got {self.hicache_storage_prefetch_policy!r}")
        if self.hicache_storage_backend and not self.enable_hierarchical_cache:
            raise ValueError("hicache_storage_backend stages its pages through host memory: it needs "
                             "enable_hierarchical_cache")
        if self.enable_hierarchical_cache and self.tensor_parallel_size > 1:
            raise ValueError("enable_hierarchical_cache with tensor_parallel_size > 1 is not built yet: the host "
                             "tier would move rank 0's KV pages only")
        if self.enable_hierarchical_cache and not self.enable_prefix_caching:
            raise ValueError("enable_hierarchical_cache keeps the prefix cache's pages: it needs prefix caching")
        if self.speculative_config is not None:
            spec = SpeculativeConfig.of(self.speculative_config)
            object.__setattr__(self, "speculative_config", spec)
            if spec.num_speculative_tokens >= self.max_num_batched_tokens:
                raise SpecConfigError("num_speculative_tokens", f"{spec.num_speculative_tokens} drafts and the token "
                                      f"they follow exceed max_num_batched_tokens {self.max_num_batched_tokens}")

    def _check_dp_attention(self) -> None:
        if not self.enable_dp_attention:
            raise ValueError(f"data_parallel_size {self.data_parallel_size} needs enable_dp_attention: data-parallel "
                             "replicas of a whole engine run as separate servers behind `engine gateway`")
        if self.data_parallel_size < 2 or self.tensor_parallel_size % self.data_parallel_size:
            raise ValueError("enable_dp_attention needs a data_parallel_size of at least 2 that divides "
                             "tensor_parallel_size (each data-parallel rank's attention tensor-parallel over "
                             f"tensor_parallel_size / data_parallel_size processes), got data_parallel_size "
                             f"{self.data_parallel_size} and tensor_parallel_size {self.tensor_parallel_size}")

    @property
    def attention_tp_size(self) -> int:
        """The processes one request's attention is split over: all of them, or under data-parallel
        attention those of its data-parallel rank."""
        if self.enable_dp_attention:
            return self.tensor_parallel_size // self.data_parallel_size
        return self.tensor_parallel_size

    @property
    def chunk_size(self) -> int | None:
        """Largest prefill chunk a step may take from one prompt, or None when chunking is off."""
        return self.chunked_prefill_size or None

    def requested_backends(self) -> dict[str, str]:
        named = {"attention": self.attention_backend, "v4_attention": self.v4_attention_backend,
                 "mhc": self.mhc_backend, "moe": self.moe_backend,
                 "linear": self.linear_backend, "norm": self.norm_backend, "sampling": self.sampling_backend,
                 "graphs": self.graph_backend,
                 "spec": self.speculative_config.method if self.speculative_config is not None else None}
        return {k: v for k, v in named.items() if v}
