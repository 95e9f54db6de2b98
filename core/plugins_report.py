"""What ``engine plugins`` prints: what was found, what runs here, and why each family picks what it picks.

A user who asks why a backend was not chosen should find the answer here without reading code:
every candidate of every family is listed with its priority and its reasons.
"""

from __future__ import annotations

from . import hookspecs
from .plugins import ENTRY_POINT_GROUP, Plugins
from .registry import Candidate, SelectionContext, SelectionError, select


def _table(rows: list[tuple[str, ...]], indents: list[str] | None = None) -> list[str]:
    """Columns padded to their widest cell; the last column is left ragged."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    indents = indents or ["  "] * len(rows)
    return [i + "  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1] for i, r in zip(indents, rows)]


def _discovery(plugins: Plugins) -> list[str]:
    lines = [f"Plugins (entry-point group {ENTRY_POINT_GROUP}):"]
    if plugins.discovered:
        rows = [(p.name, p.module, p.distribution, "loaded" if p.loaded else f"not loaded: {p.error}")
                for p in plugins.discovered]
        lines += _table([("name", "module", "distribution", "status"), *rows])
    else:
        lines.append("  (none discovered)")
    found = {p.name for p in plugins.discovered}
    direct = sorted(name for name, plugin in plugins.pm.list_name_plugin() if plugin is not None and name not in found)
    if direct:
        lines.append(f"  registered directly: {', '.join(direct)}")
    return lines


def _platform(ctx: SelectionContext) -> list[str]:
    p = ctx.platform
    caps = ", ".join(sorted(p.capabilities)) or "none"
    return [f"Platform: {p.summary()}", f"  torch device {p.torch_device}; capabilities: {caps}"]


def _candidates(candidates: tuple[Candidate, ...], chosen: str | None) -> list[str]:
    rows = [(c.descriptor.name, f"plugin {c.descriptor.plugin or '?'}", f"priority {c.priority}",
             "ok" if not c.reasons else "refuses: " + "; ".join(c.reasons)) for c in candidates]
    return _table(rows, ["  * " if c.descriptor.name == chosen else "    " for c in candidates])


_CHOSEN_BY = {"model": "chosen by the checkpoint's architecture (pass --model)",
              "spec": "off (--speculative-config names a proposer as its method)"}


def _family(plugins: Plugins, ctx: SelectionContext, family: str, requested: str | None) -> list[str]:
    try:
        descriptors = plugins.descriptors(family)
    except Exception as exc:  # one broken plugin should not hide the rest of the report
        return [f"{family}: cannot collect candidates: {type(exc).__name__}: {exc}"]
    if not descriptors:
        return [f"{family}: no candidates registered"]
    if family in _CHOSEN_BY and requested is None:  # chosen by what is served, not by priority
        names = ", ".join(sorted({d.name for d in descriptors}))
        return [f"{family}: {_CHOSEN_BY[family]}; registered: {names}"]
    asked = f" (requested {requested!r})" if requested else ""
    try:
        selection = select(family, descriptors, ctx, requested)
    except SelectionError as exc:
        head = f"{family}{asked}: nothing selected: {str(exc).splitlines()[0]}"
        return [head, *_candidates(exc.candidates, None)]
    chosen = selection.chosen
    head = f"{family}{asked}: selects {chosen.name} (plugin {chosen.plugin or '?'})"
    return [head, *_candidates(selection.candidates, chosen.name)]


def _blocks(plugins: Plugins, ctx: SelectionContext, requested: dict[str, str]) -> list[str]:
    """What serves each block of the --model's architecture: a family's selection or the model's own code."""
    try:
        model_cls = plugins.select("model", ctx, requested["model"]).create(ctx)
        chosen = {}
        for family in {family for _, family in model_cls.blocks if family in hookspecs.FAMILIES}:
            chosen[family] = plugins.select(family, ctx, requested.get(family)).chosen.name
    except Exception as exc:  # the families above already say why nothing was selected
        return [f"Blocks: cannot tell ({type(exc).__name__}: {str(exc).splitlines()[0]})"]
    rows = [(block, f"{family} backend {chosen[family]}" if family in chosen else family)
            for block, family in model_cls.blocks]
    return [f"Blocks of {requested['model']} (what runs each):", *_table(rows)]


def report(plugins: Plugins, ctx: SelectionContext, requested: dict[str, str] | None = None) -> str:
    """The discovery, the platform and, for every family, the selection with every candidate."""
    requested = dict(requested or {})
    if ctx.model_config is not None:
        requested["model"] = ctx.model_config.architecture
    lines = [*_discovery(plugins), "", *_platform(ctx), "", "Families (* is what would be selected):"]
    for family in hookspecs.FAMILIES:
        lines += _family(plugins, ctx, family, requested.get(family))
    if "model" in requested:
        lines += ["", *_blocks(plugins, ctx, requested)]
    return "\n".join(lines)
