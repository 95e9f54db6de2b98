"""Backend descriptors and the selection rule every hook family shares.

A plugin never hands the core a live object: it hands descriptors. The core drops the ones that
give reasons, takes the highest priority, and only then calls ``create`` (which imports the
implementation). A name the user chose is honoured or refused loudly, never replaced.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import import_module
from typing import Any, Callable


@dataclass(frozen=True)
class SelectionContext:
    """What a descriptor may look at to decide whether it can serve: platform, model, config."""

    platform: Any  # core.platform.PlatformSpec
    model_config: Any = None  # core.config.ModelConfig or None before a model is known
    engine_config: Any = None  # core.config.EngineConfig or None
    target: Any = None  # the loaded model, where an implementation shares its weights (MTP's proposer)


def import_path(path: str) -> Any:
    """The object a ``"package.module:name"`` path names, imported only now (``create`` calls it)."""
    module, _, name = path.partition(":")
    return getattr(import_module(module), name)


def _no_reasons(ctx: SelectionContext) -> list[str]:
    return []


@dataclass(frozen=True)
class Descriptor:
    """One implementation a plugin offers for one family.

    ``priority`` is an int or a callable of the context (priorities differ per arch).
    ``check(ctx)`` returns the reasons it cannot serve; empty means it can.
    ``create(ctx)`` builds the implementation and is the only place vendor modules are imported.
    """

    family: str
    name: str
    create: Callable[[SelectionContext], Any]
    priority: int | Callable[[SelectionContext], int] = 0
    check: Callable[[SelectionContext], list[str]] = _no_reasons
    plugin: str = field(default="", compare=False)

    def priority_for(self, ctx: SelectionContext) -> int:
        return self.priority(ctx) if callable(self.priority) else int(self.priority)


@dataclass(frozen=True)
class Candidate:
    descriptor: Descriptor
    priority: int
    reasons: tuple[str, ...]


@dataclass(frozen=True)
class Selection:
    """The outcome of selecting in one family: the winner and every candidate with its reasons."""

    family: str
    chosen: Descriptor
    candidates: tuple[Candidate, ...]
    explicit: bool

    def create(self, ctx: SelectionContext) -> Any:
        return self.chosen.create(ctx)


class SelectionError(RuntimeError):
    """No candidate can serve, or the one the user named cannot.

    ``candidates`` are every descriptor that was weighed, with its reasons, for callers that
    explain the failure in their own words (``engine plugins``).
    """

    def __init__(self, message: str, candidates: tuple[Candidate, ...] = ()) -> None:
        super().__init__(message)
        self.candidates = candidates


def _evaluate(descriptor: Descriptor, ctx: SelectionContext) -> Candidate:
    try:
        reasons = tuple(descriptor.check(ctx))
    except Exception as exc:  # a broken check is a reason, not a crash of the whole selection
        reasons = (f"check raised {type(exc).__name__}: {exc}",)
    return Candidate(descriptor, descriptor.priority_for(ctx), reasons)


def describe_candidates(candidates: tuple[Candidate, ...] | list[Candidate]) -> str:
    lines = []
    for c in candidates:
        status = "ok" if not c.reasons else "; ".join(c.reasons)
        lines.append(f"  - {c.descriptor.name} (plugin {c.descriptor.plugin or '?'}, priority {c.priority}): {status}")
    return "\n".join(lines) if lines else "  (no candidates registered)"


def select(family: str, descriptors: list[Descriptor], ctx: SelectionContext, requested: str | None = None) -> Selection:
    """Pick one descriptor of ``family``: the requested one if named, else the best that can serve."""
    candidates = tuple(
        sorted((_evaluate(d, ctx) for d in descriptors), key=lambda c: (-c.priority, c.descriptor.name))
    )
    listing = describe_candidates(candidates)
    if requested:
        named = [c for c in candidates if c.descriptor.name == requested]
        if not named:
            raise SelectionError(f"{family} backend {requested!r} is not registered; candidates:\n{listing}", candidates)
        if len(named) > 1:  # several plugins offer the name (the CUDA and ROCm Triton kernels): the one
            named = [c for c in named if not c.reasons] or named  # that can run here is the one meant
        if len(named) > 1:  # which one the user meant is unknowable; picking one would be silent
            plugins = ", ".join(c.descriptor.plugin or "?" for c in named)
            raise SelectionError(
                f"{family} backend {requested!r} is registered by several plugins ({plugins}); candidates:\n{listing}",
                candidates,
            )
        if named[0].reasons:
            raise SelectionError(
                f"{family} backend {requested!r} cannot run here: {'; '.join(named[0].reasons)}\n"
                f"candidates:\n{listing}",
                candidates,
            )
        return Selection(family, named[0].descriptor, candidates, explicit=True)
    usable = [c for c in candidates if not c.reasons]
    if not usable:
        raise SelectionError(f"no {family} backend can run here; candidates:\n{listing}", candidates)
    return Selection(family, usable[0].descriptor, candidates, explicit=False)
