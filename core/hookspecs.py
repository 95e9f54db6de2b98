"""Every hook spec: the contract between the core and its backends and plugins.

Hooks are called once, at start-up, with keyword arguments only. Provider hooks are *collecting*
(every plugin's list is gathered) and return :class:`~engine.core.registry.Descriptor` lists;
the core selects among them (see ``core/registry.py``). Nothing here is called per token.
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

import pluggy

PROJECT = "engine"
F = TypeVar("F", bound=Callable[..., Any])
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl: Callable[[F], F] = pluggy.HookimplMarker(PROJECT)


@hookspec
def engine_detect_platform() -> Any:
    """Collecting. Return a ``PlatformSpec`` if this plugin's hardware is present, else ``None``.

    Must not import a vendor module unless its hardware may be there, and never at import time.
    Exactly one non-CPU result may come back; two claims are an error, none means CPU.
    """


@hookspec
def engine_register_attention_backends() -> Any:
    """Collecting. Return a list of attention ``Descriptor``s (paged prefill/decode attention).

    ``create`` returns a ``core.families.attention.AttentionBackend``: ``forward``, and optionally
    ``rope_forward``, which gets the rotary embedding and, for Qwen3, a ``QKNorm`` (per-head q/k
    RMSNorm before the rotation) to fuse with the K/V store or apply as the default does.
    """


@hookspec
def engine_register_v4_attention_backends() -> Any:
    """Collecting. Return a list of DeepSeek-V4 attention ``Descriptor``s: ``create`` returns a
    ``core.families.v4_attention.V4AttentionBackend`` (window store, compressors, indexer, attention)."""


@hookspec
def engine_register_mhc_backends() -> Any:
    """Collecting. Return a list of mHC ``Descriptor``s: ``create`` returns a
    ``core.families.mhc.MHCBackend`` (DeepSeek-V4's hyper-connection pre/post mixes and head)."""


@hookspec
def engine_register_moe_backends() -> Any:
    """Collecting. Return a list of MoE ``Descriptor``s (routing and expert compute)."""


@hookspec
def engine_register_linear_backends() -> Any:
    """Collecting. Return a list of linear ``Descriptor``s (bf16, FP8 block-scaled, MXFP8 GEMMs)."""


@hookspec
def engine_register_norm_backends() -> Any:
    """Collecting. Return a list of norm ``Descriptor``s: ``create`` returns a
    ``core.families.norm.NormBackend`` (RMSNorm, residual add + RMSNorm, SiLU-and-mul)."""


@hookspec
def engine_register_sampling_backends() -> Any:
    """Collecting. Return a list of sampling ``Descriptor``s: ``create`` returns a
    ``core.families.sampling.SamplingBackend`` (temperature, top-k, top-p, min-p and the draw)."""


@hookspec
def engine_register_graph_backends() -> Any:
    """Collecting. Return a list of graph ``Descriptor``s (capture and replay of forward steps)."""


@hookspec
def engine_register_spec_proposers() -> Any:
    """Collecting. Return a list of speculative-decoding proposer ``Descriptor``s; ``create(ctx)``
    returns a ``core.families.spec.SpecProposer``."""


@hookspec
def engine_register_kv_transports() -> Any:
    """Collecting. Return a list of KV transport ``Descriptor``s (moving pages between engines);
    ``create(ctx)`` returns a ``core.families.kv_transport.KVTransport``."""


@hookspec
def engine_register_cache_tiers() -> Any:
    """Collecting. Return a list of cache tier ``Descriptor``s (KV pages below the device);
    ``create(ctx)`` returns a ``core.families.cache_tier.CacheTier``."""


@hookspec
def engine_register_models() -> Any:
    """Collecting. Return a list of model ``Descriptor``s; ``name`` is the HF architecture string
    (``config.json`` ``architectures[0]``) and ``create(ctx)`` returns the model class."""


@hookspec(historic=True)
def engine_configure(config: Any) -> None:
    """Historic, collecting, results ignored. Called once with the frozen ``EngineConfig`` so a
    plugin can read its options (``config.plugin_options``); plugins registered later see it too."""


FAMILIES: dict[str, str] = {
    "attention": "engine_register_attention_backends",
    "v4_attention": "engine_register_v4_attention_backends",
    "mhc": "engine_register_mhc_backends",
    "moe": "engine_register_moe_backends",
    "linear": "engine_register_linear_backends",
    "norm": "engine_register_norm_backends",
    "sampling": "engine_register_sampling_backends",
    "graphs": "engine_register_graph_backends",
    "spec": "engine_register_spec_proposers",
    "kv_transport": "engine_register_kv_transports",
    "cache_tier": "engine_register_cache_tiers",
    "model": "engine_register_models",
}
"""Family name -> the hook that collects its descriptors."""
