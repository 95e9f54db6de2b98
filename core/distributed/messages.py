"""What rank 0 and the other ranks of a tensor-parallel group tell each other over their pipes:
msgpack (msgspec), never pickle. A page table travels as its dtype, shape and bytes."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from ..runner import StepInputs


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


Message = Ready | Failed | Step | Stop


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
