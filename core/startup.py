"""Start-up: plugins, platform, backend selection, model and KV cache, resolved exactly once."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, replace

import torch

from .config import EngineConfig, ModelConfig
from .distributed.group import SINGLE, ParallelGroup, Rendezvous, rank_device
from .families.sampling import SamplingBackend
from .families.spec import SpecProposer
from .families.cache_tier import CacheTier, TierContext
from .breaks import BreakPoints, break_families, breakable_backends
from .families.graphs import GraphBackend
from .graph_runner import DecodeGraphs
from .prefill_graphs import PrefillGraphs
from .kv.hierarchy import KVHierarchy
from .kv.tier_layout import host_capacity, tier_layout
from .kv.manager import KVManager
from .kv.page_rows import PageRows
from .kv.storage import KVCache, pages_for_budget
from .models.base import Backends, CausalLM
from .plugins import Plugins, load_plugins
from .platform import PlatformSpec
from .registry import Selection, SelectionContext, SelectionError, describe_candidates
from .spec.config import SpecConfigError
from .loader import iter_checkpoint
from .models.weights import resident_bytes
from .threads import set_cpu_threads, usable_cores

logger = logging.getLogger(__name__)

BACKEND_FAMILIES = ("attention", "v4_attention", "mhc", "linear", "norm", "moe")  # the fields of models.base.Backends


@dataclass
class Components:
    plugins: Plugins
    platform: PlatformSpec
    device: torch.device
    model_config: ModelConfig
    selections: dict[str, Selection]
    model: CausalLM
    kv: KVCache
    kv_manager: KVManager
    max_model_len: int
    sampling: SamplingBackend
    graphs: DecodeGraphs | None = None
    prefill_graphs: PrefillGraphs | None = None
    verify_graphs: DecodeGraphs | None = None  # speculative decoding's verify steps of K+1 tokens a sequence
    proposer: SpecProposer | None = None  # speculative decoding's drafter, where configured
    group: ParallelGroup = SINGLE  # the tensor-parallel group this process is a rank of
    attention_group: ParallelGroup = SINGLE  # the ranks its attention is split over: ``group`` but under DP attention
    # under DP attention: where the processes agree on each step's graph (core/graph_choice.py), on the
    # host (gloo), so the exchange waits for no device work (``group`` itself where that is gloo already)
    plan_group: ParallelGroup = SINGLE


def select_model_class(plugins: Plugins, ctx: SelectionContext, architecture: str) -> type[CausalLM]:
    descriptors = plugins.descriptors("model")
    if not any(d.name == architecture for d in descriptors):
        known = ", ".join(sorted({d.name for d in descriptors})) or "none"
        raise SelectionError(f"unknown model architecture {architecture!r}; known architectures: {known}")
    return plugins.select("model", ctx, requested=architecture).create(ctx)


def model_families(model_cls: type[CausalLM]) -> list[str]:
    """The backend families the model's blocks run on, in ``BACKEND_FAMILIES`` order."""
    named = {family for _, family in model_cls.blocks}
    return [family for family in BACKEND_FAMILIES if family in named]


def select_backends(plugins: Plugins, ctx: SelectionContext, config: EngineConfig,
                    families: list[str]) -> dict[str, Selection]:
    requested = config.requested_backends()
    unused = sorted(set(requested) & set(BACKEND_FAMILIES) - set(families))
    if unused:
        logger.warning("%s requested, but the model runs no such block", ", ".join(f"--{f}-backend" for f in unused))
    selections = {family: plugins.select(family, ctx, requested.get(family)) for family in families}
    level = logging.DEBUG if ctx.platform.vendor == "cpu" else logging.INFO  # on a GPU, say why a kernel is not used
    for family, sel in selections.items():
        for c in sel.candidates:
            if c.reasons and c.priority > sel.chosen.priority_for(ctx):
                logger.log(level, "%s: %s cannot serve (%s); using %s", family, c.descriptor.name,
                           "; ".join(c.reasons), sel.chosen.name)
    return selections


def select_graphs(plugins: Plugins, ctx: SelectionContext, config: EngineConfig) -> Selection | None:
    """The graphs backend, or None for eager steps: by choice, or where nothing can capture here."""
    if config.enforce_eager:
        return None
    requested = config.requested_backends().get("graphs")
    try:
        return plugins.select("graphs", ctx, requested)
    except SelectionError:
        if requested:
            raise
        return None


def select_proposer(plugins: Plugins, ctx: SelectionContext, config: EngineConfig) -> Selection | None:
    """The proposer ``speculative_config.method`` names (None without speculation), or an error
    naming that field with every registered proposer and its reasons."""
    spec = config.speculative_config
    if spec is None:
        return None
    try:
        return plugins.select("spec", ctx, spec.method)
    except SelectionError as exc:
        named = [c for c in exc.candidates if c.descriptor.name == spec.method]
        why = f"{spec.method!r} cannot run here" if named else f"no proposer {spec.method!r} is registered"
        raise SpecConfigError("method", f"{why}; proposers:\n{describe_candidates(exc.candidates)}") from None


def capture_graphs(config: EngineConfig, explicit: bool, backend: GraphBackend, model: CausalLM, kv: KVCache,
                   max_model_len: int, device: torch.device, progress: bool,
                   proposer: SpecProposer | None = None) -> tuple[DecodeGraphs | None, DecodeGraphs | None]:
    """The decode graphs and speculative decoding's verify graphs (K+1 tokens a sequence), each None
    where not captured; both with the feature ``proposer`` drafts from, where it does."""
    unsafe = [f"{family} backend {b.name}" for family, b in vars(model.backends).items()
              if b is not None and not getattr(b, "graph_safe", True)]
    if not model.graph_safe:
        unsafe.append(type(model).__name__)
    if unsafe:
        logger.info("%s not graph-safe: decode runs eagerly", ", ".join(unsafe))
        return None, None
    feature = (proposer.feature, proposer.feature_layers) if proposer is not None else (None, ())
    graphs = _capture(config, explicit, DecodeGraphs(
        model, kv, backend, config.page_size, max_model_len, min(config.max_graph_batch, config.max_num_seqs), device,
        1, *feature), device, progress)
    if graphs is None or proposer is None:
        return graphs, None
    q = config.speculative_config.num_speculative_tokens + 1
    reasons = [f"{family} backend {b.name} takes {getattr(b, 'graph_query_len', 1)}"
               for family, b in vars(model.backends).items()
               if b is not None and family in ("attention", "v4_attention") and getattr(b, "graph_query_len", 1) < q]
    if reasons:
        logger.info("no verify graphs of %d tokens a sequence: %s; verify steps replay prefill graphs where they fit",
                    q, "; ".join(reasons))
        return graphs, None
    return graphs, _capture(config, explicit, DecodeGraphs(
        model, kv, backend, config.page_size, max_model_len, min(config.max_graph_batch, config.max_num_seqs), device,
        q, *feature), device, progress)


def _capture(config: EngineConfig, explicit: bool, graphs: DecodeGraphs, device: torch.device,
             progress: bool) -> DecodeGraphs | None:
    try:
        graphs.capture(_graph_budget(config, device), progress=progress)
    except Exception:
        if explicit or config.tensor_parallel_size > 1:  # the ranks replay together: none may run eagerly alone
            raise
        logger.exception("capturing %s graphs failed; those steps run eagerly (--enforce-eager skips the attempt)",
                         graphs.kind)
        return None
    return graphs


def capture_prefill_graphs(config: EngineConfig, explicit: bool, backend: GraphBackend, points: BreakPoints,
                           model: CausalLM, kv: KVCache, max_model_len: int, device: torch.device,
                           progress: bool, proposer: SpecProposer | None = None) -> PrefillGraphs | None:
    """Prefill steps' breakable graphs, or None (logged why) where they cannot be captured here;
    recorded with the feature ``proposer`` drafts from, where it does."""
    reasons = model.breakable_refusals()
    if not config.max_prefill_graph_tokens:
        reasons.append("max_prefill_graph_tokens is 0")
    if not backend.breakable:
        reasons.append(f"the {backend.name} graphs backend records no segments")
    if reasons:
        logger.info("no prefill graphs: %s", "; ".join(reasons))
        return None
    graphs = PrefillGraphs(model, kv, backend, points, config.page_size,
                           min(config.max_prefill_graph_tokens, config.max_num_batched_tokens, max_model_len), device,
                           proposer.feature if proposer else None, proposer.feature_layers if proposer else ())
    try:
        graphs.capture(_graph_budget(config, device), progress=progress)
    except Exception as exc:
        if explicit or config.tensor_parallel_size > 1:  # the ranks replay together: none may run eagerly alone
            raise
        logger.warning("capturing prefill graphs failed (%s: %s); prefill runs eagerly (--enforce-eager skips "
                       "the attempt)", type(exc).__name__, exc, exc_info=logger.isEnabledFor(logging.DEBUG))
        return None
    return graphs


def _graph_budget(config: EngineConfig, device: torch.device) -> int | None:
    """Bytes each kind of graph may take: as configured, else half of what the device has free."""
    if config.graph_memory is None and device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] // 2
    return config.graph_memory


def _window_pages(config: EngineConfig, model: CausalLM, max_model_len: int, max_rollback: int) -> int:
    """Window pages (0 without windowed layers): what every running sequence holds near its end
    (and its drafts, or the ``max_rollback`` tokens it may go back) plus one step's tokens, and as
    many again for the ends of cached prefixes."""
    if not any(s.windowed for s in model.kv_layer_specs()):
        return 0
    if config.window_pages is not None:
        return config.window_pages
    ps = config.page_size
    step = max(config.max_num_batched_tokens, config.chunk_size or max_model_len)
    drafts = config.speculative_config.num_speculative_tokens if config.speculative_config is not None else 0
    drafts = max(drafts, max_rollback)
    running = config.max_num_seqs * (-(-(model.window_reach() + drafts) // ps) + 2) + -(-step // ps)
    return 2 * running + 1


def _kv_pages(config: EngineConfig, model: CausalLM, device: torch.device, dtype: torch.dtype,
              max_model_len: int, window_pages: int) -> int:
    specs = model.kv_layer_specs()
    if config.num_pages is not None:
        return config.num_pages
    if config.kv_cache_memory is not None:
        budget = config.kv_cache_memory
    elif device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * config.gpu_memory_utilization)
    else:
        budget = config.cpu_kv_cache_memory
    budget -= window_pages * KVCache.bytes_per_page(specs, config.page_size, dtype, windowed=True)
    pages = pages_for_budget(budget, specs, config.page_size, dtype)
    useful = config.max_num_seqs * -(-max_model_len // config.page_size) + 1
    return min(pages, useful)


def proposer_kv(config: EngineConfig, model, device: torch.device, dtype: torch.dtype, max_model_len: int,
                max_rollback: int) -> tuple[KVCache, KVManager]:
    """A proposer's own KV cache and manager for ``model`` (its ``kv_layer_specs`` and
    ``window_reach``), sized by the engine's config as the target's is, in this one process."""
    window_pages = _window_pages(config, model, max_model_len, max_rollback)
    if config.num_pages is None and all(s.windowed for s in model.kv_layer_specs()):
        num_pages = config.max_num_seqs * -(-max_model_len // config.page_size) + 1  # hold no bytes: ids only
    else:
        num_pages = _kv_pages(config, model, device, dtype, max_model_len, window_pages)
    window_pages = min(window_pages, num_pages)
    kv = KVCache(model.kv_layer_specs(), num_pages, config.page_size, dtype, device, window_pages)
    return kv, KVManager(num_pages, config.page_size, config.enable_prefix_caching, kv, window_pages,
                         model.window_reach(), max_rollback, max_seq_len=max_model_len)


def model_key(model_config: ModelConfig, page_size: int) -> str:
    """The model as content keys of KV pages name it: its config, element type, quantization and
    the page size (``tier_layout`` adds the record layout)."""
    return json.dumps([model_config.architecture, model_config.hf, str(model_config.dtype), model_config.quantization,
                       page_size], sort_keys=True, default=str)


def attach_host_tier(plugins: Plugins, ctx: SelectionContext, kv: KVCache, kv_manager: KVManager,
                     rows: PageRows | None = None) -> None:
    """The hierarchical cache's host tier (L2, the cache-tier family's ``host``), sized and attached;
    a proposer's ``rows`` of each page go with the pages."""
    config = ctx.engine_config
    layout = tier_layout(kv, model_key(ctx.model_config, config.page_size), rows)
    capacity = host_capacity(kv, layout, config.hicache_ratio, int(config.hicache_size * 2**30))
    tier_ctx = TierContext(ctx.platform, ctx.model_config, config, layout, capacity, kv.device)
    tier = plugins.select("cache_tier", tier_ctx, "host").create(tier_ctx)
    lower = kv_manager.attach_lower(tier, config.hicache_write_policy, layout.model, kv, rows)
    if config.hicache_storage_backend:
        attach_storage_tier(plugins, lower, config)
    logger.info("hierarchical cache: host tier %s (%s) holds %s records (%.1f MiB), %s",
                tier.name, config.hicache_mem_layout, capacity,
                sum(n * layout.record_bytes(k) for k, n in capacity.items()) / 2**20, config.hicache_write_policy)


def attach_storage_tier(plugins: Plugins, lower: KVHierarchy, config: EngineConfig) -> CacheTier:
    """The storage tier (L3) ``config`` names (``hicache_storage_backend``, a cache tier other than
    host memory), selected, created and attached below ``lower``'s host tier, in place of any before it."""
    if config.hicache_storage_backend == lower.tier.name:
        raise SelectionError(f"{lower.tier.name!r} is the host-memory tier (L2), not a storage backend")
    host = lower.tier.ctx
    ctx = TierContext(host.platform, host.model_config, config, host.layout, {}, host.device)
    storage = plugins.select("cache_tier", ctx, config.hicache_storage_backend).create(ctx)
    lower.attach_storage(storage, config.hicache_storage_prefetch_policy, config.hicache_storage_prefetch_threshold)
    logger.info("hierarchical cache: storage tier %s attached, prefetch %s from %d tokens", storage.name,
                config.hicache_storage_prefetch_policy, config.hicache_storage_prefetch_threshold)
    return storage


def build(config: EngineConfig, plugins: Plugins | None = None, progress: bool = True,
          rendezvous: Rendezvous | None = None, max_rollback: int = 0) -> Components:
    """Everything one rank runs; ``rendezvous``: where this rank meets the others of its
    tensor-parallel group (None: one process); ``max_rollback``: how many tokens back a sequence's
    KV may be rolled back over several steps (a draft model's, core/spec/draft_model.py)."""
    started = time.monotonic()
    plugins = plugins or load_plugins()
    plugins.pm.hook.engine_configure.call_historic(kwargs={"config": config})
    platform = plugins.detect_platform(config.device)
    device = torch.device(config.device or platform.torch_device)
    group = attention = plan = SINGLE
    if rendezvous is not None:
        device = rank_device(device, rendezvous.rank)
        group = attention = rendezvous.connect(device)
        if config.enable_dp_attention:  # each data-parallel rank's processes (dp_attention.py)
            attention = rendezvous.split(device, config.attention_tp_size, "attention")
            plan = group if device.type == "cpu" else rendezvous.connect(torch.device("cpu"), "plan")
        if device.type == "cpu":  # the ranks share the host's cores: threads that spin on a busy core stall all
            set_cpu_threads(max(1, (config.cpu_threads or usable_cores()) // group.size))
    if config.cpu_threads and (group.size == 1 or device.type != "cpu"):
        set_cpu_threads(config.cpu_threads)
    model_config = ModelConfig.from_dir(config.model, config.dtype, device.type, config.max_model_len,
                                        config.quantization, config.engram_placement,
                                        config.enable_swa_bounded_replay)
    ctx = SelectionContext(platform=platform, model_config=model_config, engine_config=config)
    model_cls = select_model_class(plugins, ctx, model_config.architecture)
    selections = select_backends(plugins, ctx, config, model_families(model_cls))
    graph_selection = select_graphs(plugins, ctx, config)
    proposer_selection = select_proposer(plugins, ctx, config)
    # under data-parallel attention the layers but the MoE ones are split over the data-parallel rank's
    # processes only (dp_attention.py)
    points = BreakPoints()  # where a recorded prefill breaks: the calls shaped by the step's sequences
    families = {family: sel.create(ctx) for family, sel in selections.items()}
    if graph_selection is not None:
        families = breakable_backends(families, points)
        logger.debug("prefill graphs break at the %s calls", ", ".join(break_families(families)))
    backends = Backends(**families, tp=attention, expert_parallel=config.expert_parallel, moe_group=group,
                        dp_attention=config.enable_dp_attention)
    selections["sampling"] = plugins.select("sampling", ctx, config.requested_backends().get("sampling"))
    if proposer_selection is not None:
        selections["spec"] = proposer_selection
    logger.info("platform %s; %s", platform.summary(),
                ", ".join(f"{f}={s.chosen.name}" for f, s in selections.items()))

    model = model_cls(model_config, backends, device=device)
    if config.enable_swa_bounded_replay and not model.replay_tail:
        raise ValueError(f"enable_swa_bounded_replay: {model_config.architecture} has no encoder/decoder split "
                         f"whose decoder layers a prefill could replay over a bounded suffix")
    model.load_weights(iter_checkpoint(model_config.path, progress=progress, part=model.checkpoint_part))
    model.eval()
    held, weights = resident_bytes(model)
    logger.info("weights: %.1f MiB resident for %d parameters, %.3f bytes per parameter",
                held / 2**20, weights, held / max(weights, 1))

    max_model_len = model_config.max_model_len
    window_pages = _window_pages(config, model, max_model_len, max_rollback)
    num_pages = _kv_pages(config, model, device, model_config.dtype, max_model_len, window_pages)
    if group.size > 1:  # every rank holds the pages rank 0's KV manager hands out (the same count under DP attention)
        num_pages = int(group.all_reduce(torch.tensor([num_pages], device=device), op="min").item())
    window_pages = min(window_pages, num_pages)  # one per page never runs short
    capacity = (num_pages - 1) * config.page_size
    if capacity < max_model_len:
        logger.warning("KV cache holds %d tokens, fewer than max_model_len %d: max_model_len lowered to fit",
                       capacity, max_model_len)
        max_model_len = capacity
    specs = model.kv_layer_specs()
    kv = KVCache(specs, num_pages, config.page_size, model_config.dtype, device, window_pages)
    kv_manager = KVManager(num_pages, config.page_size, config.enable_prefix_caching, kv, window_pages,
                           model.window_reach(), max_rollback, max_seq_len=max_model_len)
    per_page = [KVCache.bytes_per_page(specs, config.page_size, model_config.dtype, w) for w in (False, True)]
    logger.info("loaded %s (%s, %s) in %.1fs; KV cache %d pages of %d tokens (%.1f MiB, %.1f bytes a token), "
                "%d window pages (%.1f MiB)", model_config.architecture, model_config.dtype, device,
                time.monotonic() - started, num_pages, config.page_size, per_page[0] * num_pages / 2**20,
                per_page[0] / config.page_size, window_pages, per_page[1] * window_pages / 2**20)
    proposer = proposer_selection.create(replace(ctx, target=model)) if proposer_selection is not None else None
    if config.enable_hierarchical_cache:  # host memory: after the proposer, whose rows go with the pages
        attach_host_tier(plugins, ctx, kv, kv_manager, proposer.page_rows() if proposer is not None else None)
    graphs = prefill_graphs = verify_graphs = None
    if graph_selection is not None:  # one backend, one memory pool: prefill's buckets, then decode's
        selections["graphs"] = graph_selection
        graph_backend, explicit = graph_selection.create(ctx), graph_selection.explicit
        prefill_graphs = capture_prefill_graphs(config, explicit, graph_backend, points, model, kv, max_model_len,
                                                device, progress, proposer)
        graphs, verify_graphs = capture_graphs(config, explicit, graph_backend, model, kv, max_model_len, device,
                                               progress, proposer)
    return Components(plugins, platform, device, model_config, selections, model, kv, kv_manager, max_model_len,
                      selections["sampling"].create(ctx), graphs, prefill_graphs, verify_graphs, proposer, group,
                      attention, plan)
