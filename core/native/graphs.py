"""Graphs on the CPU: a segment is the list of torch operations it ran, replayed on the same tensors.

It has a graph's semantics without a device: the recording runs each operation and keeps it with
its arguments and outputs; a replay runs it again on the same tensors, writing each result into
the tensor the recording produced, so everything downstream reads the new values where it read
the old. Views need no replay (they alias what they view); in-place operations run again as
they are. Collectives, which reach their process group without passing torch's dispatcher, are
kept in their place by ``host_work`` (core/families/graphs.py) and run again as they are. No
faster than running eagerly: it is how the graph machinery is exercised where there is no GPU. A
host read of a tensor's value (an op that returns no tensor: ``.item()``, ``bool(t)``), which a
device graph cannot replay either, is refused; ``.tolist()``, which torch does not dispatch, is
not seen.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..families.graphs import HOST_WORK, GraphBackend


_aten = torch.ops.aten
# the ops that hand the host a tensor's value: .item(), float(t), bool(t), torch.equal
_HOST_READS = frozenset((_aten.item, _aten._local_scalar_dense, _aten.is_nonzero, _aten.equal))


class _Tape(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        # (op, args, kwargs, the tensors it made: None where it wrote in place)
        self.ops: list[tuple[Any, tuple, dict, list[torch.Tensor] | None]] = []
        self._host = None

    def __enter__(self):
        self._host = HOST_WORK.set(self.ops)
        return super().__enter__()

    def __exit__(self, *exc):
        HOST_WORK.reset(self._host)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket in _HOST_READS:
            raise RuntimeError("a recorded segment read a tensor's value on the host, which a replay cannot repeat")
        out = func(*args, **kwargs)
        if any(r.alias_info is not None and r.alias_info.is_write for r in func._schema.returns):
            self.ops.append((func, args, kwargs, None))  # in place: it writes its recorded outputs itself
        elif not _aliases_input(func, args, kwargs, out):
            self.ops.append((func, args, kwargs, [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]))
        return out


def _aliases_input(func, args, kwargs, out) -> bool:
    """A view of an argument (it reads its new values by itself); not an op that may alias but copied."""
    if not any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns):
        return False
    inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
    return all(t.untyped_storage().data_ptr() in inputs for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))


def _replay(ops: list[tuple[Any, tuple, dict, list[torch.Tensor] | None]]) -> None:
    for func, args, kwargs, outputs in ops:
        result = func(*args, **kwargs)
        if outputs is None:
            continue
        if len(outputs) == 1 and isinstance(result, torch.Tensor):
            outputs[0].copy_(result)
            continue
        for old, new in zip(outputs, (t for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor))):
            old.copy_(new)


class RecordedOps(GraphBackend):
    name = "recorded"
    breakable = True

    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        self._tape: _Tape | None = None

    def capture(self, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        self.begin_segment()
        try:
            out = fn()
        finally:
            replay = self.end_segment()

        def run() -> torch.Tensor:
            replay()
            return out

        return run

    def begin_segment(self) -> None:
        self._tape = _Tape()
        self._tape.__enter__()

    def end_segment(self) -> Callable[[], None]:
        tape, self._tape = self._tape, None
        tape.__exit__(None, None, None)
        return lambda: _replay(tape.ops)

    def carry(self, value: torch.Tensor) -> torch.Tensor:
        return value  # made outside the segment: the recording reads it where a replay's writes land

    def unowned(self, t: torch.Tensor) -> torch.Tensor:
        return t  # host memory is not pooled: the tape holds what it read anyway
