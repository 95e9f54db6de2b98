"""Breaks: where a recorded forward stops being a graph and runs eagerly.

A breakable graph (core/prefill_graphs.py) records a step's forward as segments of device work
with breaks between them: the calls whose work depends on the step's shape (its sequences and
their lengths), which run eagerly in every replay, on that step's batch. The break points are the
attention families' calls (their work is shaped by the sequences) and the calls of any other
family whose backend is not graph-safe (a native MoE sizes its experts' slices on the host). The
models need not know: at start-up those backends are wrapped (``breakable_backends``), and while
a ``SegmentRecorder`` records, each call ends the segment before it, runs, and starts the next.

A break's arguments are replayed as the recording saw them, except: the recorded batch becomes the
step's (and each of its tensors, the step's), a tensor with a row per token is cut to the step's
tokens (the bucket's padding never reaches a break, so padding writes no KV), and a result of an
earlier break that is not a tensor (per-step metadata) is that break's result in this replay. A
tensor result is copied into the buffer the segments after it read (rows past the step's
tokens zeroed), so it must have a row per token; any other tensor argument fails the capture.
Within ``bucket_shaped`` (core/families/graphs.py: a padded MoE exchange, whose blocks the bucket
sizes) a break's tensor arguments and results are the bucket's whole, uncut in every replay.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .families.attention import AttentionBackend
from .families.graphs import GraphBackend, in_bucket_shape
from .families.linear import LinearBackend
from .families.mhc import MHCBackend
from .families.moe import MoEBackend
from .families.norm import NormBackend
from .families.v4_attention import V4AttentionBackend
from .forward import ForwardBatch

FAMILIES = {"attention": AttentionBackend, "v4_attention": V4AttentionBackend, "moe": MoEBackend,
            "linear": LinearBackend, "norm": NormBackend, "mhc": MHCBackend}
ALWAYS = ("attention", "v4_attention")  # shaped by the sequences, whatever the backend
_BATCH_TENSORS = ("input_ids", "positions", "query_start_loc", "seq_lens", "context_lens", "page_table",
                  "slot_mapping", "logits_indices")


class CaptureError(RuntimeError):
    """A forward that cannot be recorded in segments, and why."""


class BreakPoints:
    """What the wrapped backends ask whether a forward is being recorded (one per engine)."""

    def __init__(self) -> None:
        self.recorder: SegmentRecorder | None = None


class Breakable:
    """A backend whose family calls pass straight through, or, while ``points`` records, are breaks."""

    def __init__(self, inner: Any, family: type, points: BreakPoints) -> None:
        self.inner = inner
        for name in dir(family):
            if not name.startswith("_") and callable(getattr(family, name)):
                setattr(self, name, _through(inner, name, points))

    def __getattr__(self, name: str) -> Any:  # attributes that are no family call: the backend's own
        return getattr(self.inner, name)


def _through(inner: Any, name: str, points: BreakPoints) -> Callable:
    def through(*args, **kwargs):
        recorder = points.recorder
        if recorder is None:
            return getattr(inner, name)(*args, **kwargs)
        return recorder.brk(getattr(inner, name), args, kwargs)

    return through


def breakable_backends(backends: dict[str, Any], points: BreakPoints) -> dict[str, Any]:
    """The backends by family, those whose calls are break points wrapped."""
    return {family: Breakable(b, FAMILIES[family], points)
            if b is not None and (family in ALWAYS or not getattr(b, "graph_safe", True)) else b
            for family, b in backends.items()}


def break_families(backends: dict[str, Any]) -> list[str]:
    """The families ``breakable_backends`` wrapped."""
    return [family for family, b in backends.items() if isinstance(b, Breakable)]


@dataclass(frozen=True)
class _Field:
    name: str  # the step batch's tensor of that name


@dataclass(frozen=True)
class _Tokens:
    tensor: torch.Tensor  # a row per token of the bucket: cut to the step's


@dataclass(frozen=True)
class _Whole:
    tensor: torch.Tensor  # shaped by the bucket: passed whole


@dataclass(frozen=True)
class _Result:
    index: int  # the result of that break in this replay


_BATCH = object()


@dataclass
class Break:
    call: Callable
    args: tuple
    kwargs: dict
    outputs: list[torch.Tensor | None] | None  # the buffers tensor results are copied into; None: none
    index: int  # where a result that is no tensor goes in a replay's results
    whole: bool = False  # recorded within ``bucket_shaped``: its results are copied whole

    def run(self, batch: ForwardBatch, results: dict[int, Any]) -> None:
        n = batch.num_tokens

        def arg(a):
            if a is _BATCH:
                return batch
            if isinstance(a, _Field):
                return getattr(batch, a.name)
            if isinstance(a, _Tokens):
                return a.tensor[:n]
            if isinstance(a, _Whole):
                return a.tensor
            if isinstance(a, _Result):
                return results[a.index]
            if type(a) is tuple:
                return tuple(map(arg, a))
            return a

        out = self.call(*map(arg, self.args), **{k: arg(v) for k, v in self.kwargs.items()})
        if self.outputs is None:
            results[self.index] = out
            return
        for buffer, value in zip(self.outputs, out if isinstance(out, tuple) else (out,)):
            if buffer is not None and self.whole:
                buffer.copy_(value)
            elif buffer is not None:
                buffer[:n].copy_(value)
                buffer[n:].zero_()


class SegmentRecorder:
    """Records one forward of a bucket of ``num_tokens`` tokens on ``batch`` as segments and breaks."""

    def __init__(self, graphs: GraphBackend, batch: ForwardBatch) -> None:
        self.graphs = graphs
        self.batch = batch
        self.num_tokens = batch.num_tokens
        self.steps: list[Callable[[], None] | Break] = []  # segment replays and breaks, in order
        self._results: dict[int, tuple[int, Any]] = {}  # id of a non-tensor result -> (break, the result)
        self._open = self._in_break = False

    @property
    def breaks(self) -> list[Break]:
        return [s for s in self.steps if isinstance(s, Break)]

    def record(self, forward: Callable[[], torch.Tensor]) -> torch.Tensor:
        self.graphs.begin_segment()
        self._open = True
        try:
            out = forward()
        except BaseException:
            if self._open:
                with contextlib.suppress(Exception):  # the capture is abandoned: end it, whatever it holds
                    self.graphs.end_segment()
            raise
        self.steps.append(self.graphs.end_segment())
        self._open = False
        self._results.clear()  # the recording's own metadata: no longer needed
        return out

    def replay(self, batch: ForwardBatch) -> None:
        results: dict[int, Any] = {}
        for step in self.steps:
            if isinstance(step, Break):
                step.run(batch, results)
            else:
                step()

    def brk(self, call: Callable, args: tuple, kwargs: dict) -> Any:
        if self._in_break:  # a break's own calls into other wrapped backends are part of it
            return call(*args, **kwargs)
        self.steps.append(self.graphs.end_segment())
        self._open = False
        index, whole = len(self.steps), in_bucket_shape()
        marked = tuple(self._mark(call, a, whole) for a in args), {k: self._mark(call, v, whole)
                                                                    for k, v in kwargs.items()}
        self._in_break = True
        try:
            out = call(*args, **kwargs)
        finally:
            self._in_break = False
        self.graphs.begin_segment()
        self._open = True
        outputs = None
        if out is None or isinstance(out, torch.Tensor) or (
                isinstance(out, tuple) and all(o is None or isinstance(o, torch.Tensor) for o in out)):
            carried = tuple(None if o is None else self.graphs.carry(o) if whole else self._carry(call, o)
                            for o in (out if isinstance(out, tuple) else (out,)))
            outputs = [None if c is None else self.graphs.unowned(c) for c in carried]
            out = carried if isinstance(out, tuple) else carried[0]
        else:
            self._results[id(out)] = (index, out)  # the object kept, so its id stays its own
        self.steps.append(Break(call, *marked, outputs, index, whole))
        return out

    def _carry(self, call: Callable, value: torch.Tensor) -> torch.Tensor:
        if value.dim() == 0 or value.shape[0] != self.num_tokens:
            raise CaptureError(f"{_name(call)} returned a tensor of shape {tuple(value.shape)}: a break's tensor "
                               f"results need a row per token ({self.num_tokens})")
        return self.graphs.carry(value)

    def _mark(self, call: Callable, a: Any, whole: bool) -> Any:
        if a is self.batch:
            return _BATCH
        if isinstance(a, torch.Tensor):
            for name in _BATCH_TENSORS:
                if getattr(self.batch, name) is a:
                    return _Field(name)
            if whole:
                return _Whole(self.graphs.unowned(a))
            if a.dim() and a.shape[0] == self.num_tokens:
                return _Tokens(self.graphs.unowned(a))
            raise CaptureError(f"{_name(call)} takes a tensor of shape {tuple(a.shape)}, neither the batch's nor "
                               f"one with a row per token ({self.num_tokens})")
        if id(a) in self._results:
            return _Result(self._results[id(a)][0])
        if type(a) is tuple:  # a group of arguments (the V4 indexer's projections): each marked
            return tuple(self._mark(call, x, whole) for x in a)
        return a


def _name(call: Callable) -> str:
    owner = getattr(call, "__self__", None)
    return f"{type(owner).__name__}.{call.__name__}" if owner is not None else getattr(call, "__name__", repr(call))
