"""Messages between the API process and the engine process: msgpack through msgspec, typed.

Every message is a tagged ``msgspec.Struct``; decoding checks the shape and types, so nothing
from a socket becomes an arbitrary object (no pickle anywhere). Outputs are the engine core's own
typed deltas (``EngineCoreOutput``): the tokens a step added, so a long generation costs the same
per step at its end as at its start.
"""

from __future__ import annotations

import dataclasses
import typing

import msgspec

from ..core.disagg.counters import TransferCounters
from ..core.kv.hicache_stats import HiCacheStats
from ..core.outputs import EngineCoreOutput
from ..core.sampling_params import SamplingParams
from ..core.spec.counters import SpecCounters

# ---- API process -> engine process ----

# SamplingParams' fields with their types and defaults, built from the dataclass so the two never
# drift; an unknown field or a wrong type fails the decode. Stop strings stay in the API process.
_HINTS = typing.get_type_hints(SamplingParams)
EngineParams = msgspec.defstruct(
    "EngineParams",
    [(f.name, _HINTS[f.name], f.default) for f in dataclasses.fields(SamplingParams) if f.name != "stop"],
    forbid_unknown_fields=True, module=__name__)


def engine_params(params: SamplingParams) -> EngineParams:
    return EngineParams(**{f: getattr(params, f) for f in EngineParams.__struct_fields__})


def sampling_params(params: EngineParams) -> SamplingParams:
    """The engine's SamplingParams; their own checks raise ``InvalidRequest`` naming the field."""
    return SamplingParams(**msgspec.structs.asdict(params))


class AddRequest(msgspec.Struct, tag="add"):
    request_id: str
    prompt_token_ids: list[int]
    params: EngineParams


class AddEnvelope(msgspec.Struct, tag="add"):
    """What an ``AddRequest`` that failed to decode may still say: whom to answer."""

    request_id: str


class AbortRequest(msgspec.Struct, tag="abort"):
    request_id: str


class FinishSequence(msgspec.Struct, tag="finish_seq"):
    """One completion reached a stop string (seen by the API process's detokenizer)."""

    request_id: str
    index: int
    stop: str


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


class AttachStorage(msgspec.Struct, tag="attach_storage"):
    """Attach the storage tier (L3) between steps (EngineCore.attach_storage); answered by ``StorageDone``."""

    admin_id: str
    backend: str
    directory: str | None = None
    prefetch_policy: str | None = None
    prefetch_threshold: int | None = None
    max_size: float | None = None  # GiB the file backend's directory may hold


class DetachStorage(msgspec.Struct, tag="detach_storage"):
    admin_id: str


ToEngine = AddRequest | AbortRequest | FinishSequence | Shutdown | AttachStorage | DetachStorage


# ---- engine process -> API process ----


class Stats(msgspec.Struct):
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    spec: SpecCounters | None = None  # where speculative decoding is on
    hicache: HiCacheStats | None = None  # where the hierarchical cache is on
    kv_transfer: TransferCounters | None = None  # on a decode engine of disaggregated serving


class Ready(msgspec.Struct, tag="ready"):
    """The engine loaded its model and serves; what the API process needs to validate requests."""

    max_model_len: int
    vocab_size: int
    num_pages: int
    page_size: int


class Outputs(msgspec.Struct, tag="outputs"):
    deltas: list[EngineCoreOutput]
    stats: Stats


class Rejected(msgspec.Struct, tag="rejected"):
    """The engine refused a request at admission: an ``EngineError``'s parts (core/errors.py)."""

    request_id: str
    code: str
    detail: str
    field: str | None = None


class StorageDone(msgspec.Struct, tag="storage_done"):
    """The answer to ``AttachStorage`` / ``DetachStorage``: the storage tier attached now, and where
    the command was refused, an ``EngineError``'s parts."""

    admin_id: str
    backend: str | None = None
    code: str | None = None
    detail: str | None = None
    field: str | None = None


class Heartbeat(msgspec.Struct, tag="heartbeat"):
    stats: Stats


class Alive(msgspec.Struct, tag="alive"):
    """The engine loop makes progress (sent by a thread beside it; see liveness.py)."""


class Failed(msgspec.Struct, tag="failed"):
    """The engine loop died; the message says why. The process exits after sending it."""

    message: str


FromEngine = Ready | Outputs | Rejected | StorageDone | Heartbeat | Alive | Failed

to_engine_decoder = msgspec.msgpack.Decoder(ToEngine)
envelope_decoder = msgspec.msgpack.Decoder(AddEnvelope)
from_engine_decoder = msgspec.msgpack.Decoder(FromEngine)
encoder = msgspec.msgpack.Encoder()
