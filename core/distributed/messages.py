"""What rank 0 and the other ranks of a tensor-parallel group tell each other over their pipes:
msgpack (msgspec), never pickle. A page table travels as its dtype, shape and bytes. Under
data-parallel attention (dp_attention.py) rank 0 sends each rank its requests with every step
(``RankRequests``) and the rank answers with its outputs (``RankOutputs``) on a second pipe."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from ..outputs import EngineCoreOutput
from ..runner import StepInputs
from ..sampling_params import SamplingParams
from ..spec.counters import SpecCounters


class Ready(msgspec.Struct, tag=True):
    """A rank has its weights and KV cache and waits for steps."""

    rank: int


class Failed(msgspec.Struct, tag=True):
    """A rank could not start (or stopped): why."""

    rank: int
    error: str


class Step(msgspec.Struct, tag=True, gc=False):
    inputs: StepInputs


class Stop(msgspec.Struct, tag=True):
    pass


class Idle(msgspec.Struct, tag=True):
    """A step in which a data-parallel rank has nothing scheduled: its processes run the MoE exchanges."""


class DraftCount(msgspec.Struct, tag=True):
    """Under data-parallel attention: join the data-parallel ranks' count of the step's drafting
    forwards (core/spec/mtp.py), offering none."""


class Draft(msgspec.Struct, tag=True, gc=False):
    """One drafting forward of a proposer's layer (MTP): its host data, or None for one with no tokens."""

    inputs: StepInputs | None


class DraftBlock(msgspec.Struct, tag=True, gc=False):
    """One block of DSpark stages (core/spec/dspark/proposer.py): per sequence its anchor token, the
    anchor's position and how many context rows it reads (the rows themselves are broadcast), and
    the drafts a sequence takes at most."""

    anchors: list[int]
    positions: list[int]
    context_lens: list[int]
    k: int


class AddRequest(msgspec.Struct, array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


class RankRequests(msgspec.Struct, tag=True):
    """A data-parallel step: run one step, after taking these (and zeroing the rank's counters first
    if rank 0's were zeroed since the last step, and emptying its prefix cache if asked)."""

    adds: list[AddRequest]
    aborts: list[str]
    finishes: list[tuple[str, int, str]]  # (request id, completion index, stop string)
    reset_counters: bool = False
    reset_prefix_cache: bool = False  # after the warm-up (core/warmup.py)


class RankStats(msgspec.Struct, array_like=True):
    """A data-parallel rank's gauges and prefix-cache totals."""

    num_running: int
    num_waiting: int
    kv_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    spec: SpecCounters | None = None  # speculative decoding's totals, where it is on


class RankOutputs(msgspec.Struct, tag=True):
    """What a data-parallel rank's step changed, the requests that failed in it, its gauges after it."""

    outputs: list[EngineCoreOutput]
    failures: list[tuple[str, str, str, str | None]]  # (request id, error code, detail, field)
    stats: RankStats


Message = Ready | Failed | Step | Stop | Idle | DraftCount | Draft | DraftBlock | RankRequests | RankOutputs


def _enc(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return (obj.dtype.str, obj.shape, obj.tobytes())
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def _dec(kind: type, obj: Any) -> Any:
    if kind is np.ndarray:
        dtype, shape, data = obj
        return np.frombuffer(data, dtype=np.dtype(dtype)).reshape(shape)
    raise NotImplementedError(f"cannot decode {kind}")


encoder = msgspec.msgpack.Encoder(enc_hook=_enc)
decoder = msgspec.msgpack.Decoder(Message, dec_hook=_dec)
