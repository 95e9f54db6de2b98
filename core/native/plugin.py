"""The torch-native backend as a plugin: the CPU backend and the oracle of every faster one.

Registered through the ``engine.plugins`` entry point like any third-party plugin. Priorities
are low, so a device backend that can serve wins; ``--attention-backend native`` still picks it.
"""

from __future__ import annotations

from ..hookspecs import hookimpl
from ..registry import Descriptor, import_path

NATIVE_PRIORITY = 0


def _instance(path: str):
    return lambda ctx: import_path(path)(ctx)


@hookimpl
def engine_register_attention_backends() -> list[Descriptor]:
    return [Descriptor("attention", "native", _instance("engine.core.native.attention:NativeAttention"),
                       priority=NATIVE_PRIORITY)]


@hookimpl
def engine_register_v4_attention_backends() -> list[Descriptor]:
    return [Descriptor("v4_attention", "native", _instance("engine.core.native.v4_attention:NativeV4Attention"),
                       priority=NATIVE_PRIORITY)]


@hookimpl
def engine_register_mhc_backends() -> list[Descriptor]:
    return [Descriptor("mhc", "native", _instance("engine.core.native.mhc:NativeMHC"), priority=NATIVE_PRIORITY)]


@hookimpl
def engine_register_moe_backends() -> list[Descriptor]:
    return [Descriptor("moe", "native", _instance("engine.core.native.moe:NativeMoE"), priority=NATIVE_PRIORITY)]


@hookimpl
def engine_register_linear_backends() -> list[Descriptor]:
    return [Descriptor("linear", "native", _instance("engine.core.native.linear:NativeLinear"),
                       priority=NATIVE_PRIORITY)]


@hookimpl
def engine_register_norm_backends() -> list[Descriptor]:
    return [Descriptor("norm", "native", _instance("engine.core.native.norm:NativeNorm"), priority=NATIVE_PRIORITY)]


@hookimpl
def engine_register_sampling_backends() -> list[Descriptor]:
    return [Descriptor("sampling", "native", _instance("engine.core.native.sampling:NativeSampling"),
                       priority=NATIVE_PRIORITY)]


@hookimpl
def engine_register_kv_transports() -> list[Descriptor]:
    return [Descriptor("kv_transport", "tcp", _instance("engine.core.native.kv_tcp:TcpTransport"),
                       priority=NATIVE_PRIORITY)]


@hookimpl
def engine_register_graph_backends() -> list[Descriptor]:
    return [Descriptor("graphs", "recorded", _instance("engine.core.native.graphs:RecordedOps"),
                       priority=NATIVE_PRIORITY, check=_recorded_reasons)]


def _recorded_reasons(ctx) -> list[str]:
    named = ctx.engine_config.requested_backends()
    if named.get("graphs") != "recorded":
        return ["replays recorded torch operations, no faster than running them: only where named "
                "(--graph-backend recorded)"]
    kernels = [f"{family} backend {name}" for family, name in named.items()
               if family not in ("graphs", "sampling", "spec") and name != "native"]
    if kernels:
        return [f"records torch operations only, and the {', '.join(kernels)} launches kernels of its own"]
    return []


def _ngram_reasons(ctx) -> list[str]:
    spec = getattr(ctx.engine_config, "speculative_config", None)
    if spec is not None and spec.model is not None:
        return ["speculative_config.model: n-gram drafts from the request's own tokens and loads no model"]
    return []


@hookimpl
def engine_register_spec_proposers() -> list[Descriptor]:
    return [Descriptor("spec", "ngram", _instance("engine.core.spec.ngram:NgramProposer"), priority=NATIVE_PRIORITY,
                       check=_ngram_reasons),
            Descriptor("spec", "draft_model", _instance("engine.core.spec.draft_model:DraftModelProposer"),
                       priority=NATIVE_PRIORITY, check=_draft_reasons),
            Descriptor("spec", "mtp", _instance("engine.core.spec.mtp:MTPProposer"), priority=NATIVE_PRIORITY,
                       check=_mtp_reasons),
            Descriptor("spec", "dspark", _instance("engine.core.spec.dspark.proposer:DSparkProposer"),
                       priority=NATIVE_PRIORITY, check=_dspark_reasons)]


def _dspark_reasons(ctx) -> list[str]:
    from ..spec.dspark.proposer import dspark_reasons

    return dspark_reasons(ctx)


def _mtp_reasons(ctx) -> list[str]:
    from ..spec.mtp import mtp_reasons

    return mtp_reasons(ctx)


def _draft_reasons(ctx) -> list[str]:
    from ..spec.draft_model import draft_reasons

    return draft_reasons(ctx)


@hookimpl
def engine_register_cache_tiers() -> list[Descriptor]:
    return [Descriptor("cache_tier", "host", _instance("engine.core.tiers.host:HostTier"), priority=NATIVE_PRIORITY),
            Descriptor("cache_tier", "file", _instance("engine.core.tiers.file:FileTier"), priority=NATIVE_PRIORITY,
                       check=_file_reasons)]


def _file_reasons(ctx) -> list[str]:
    from ..tiers.file import file_reasons

    return file_reasons(ctx)

