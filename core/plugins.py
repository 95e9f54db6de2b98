"""Loading plugins from entry points and selecting one implementation per family.

Built-in backends (``core.native``, ``backends.cuda``, ``backends.rocm``) are found through the
``engine.plugins`` entry-point group exactly as third-party packages are. ``ENGINE_PLUGINS=a,b``
limits which entry points load; ``ENGINE_TRACE_PLUGINS=1`` logs every hook call. The built-in
model catalogue is no backend's: the core registers it itself, so every selection has its models.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import pluggy

from . import hookspecs
from .models import catalogue
from .platform import PlatformSpec
from .registry import Descriptor, Selection, SelectionContext, SelectionError, select

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "engine.plugins"
CPU_PLATFORM = PlatformSpec(vendor="cpu", arch="cpu", device_name="host CPU", torch_device="cpu")


@dataclass
class PluginInfo:
    name: str
    module: str
    distribution: str
    loaded: bool
    error: str = ""


@dataclass
class Plugins:
    """A loaded plugin manager plus what was discovered; resolve hooks through it at start-up."""

    pm: pluggy.PluginManager
    discovered: list[PluginInfo] = field(default_factory=list)
    trace: bool = False

    def _call(self, impl: pluggy.HookImpl) -> Any:
        """Call one plugin's implementation directly, so results stay attributed to their plugin.

        Direct calls bypass pluggy's call monitoring, hence the trace here.
        """
        result = impl.function()
        if self.trace:
            logger.info("hook %s of plugin %s -> %r", impl.function.__name__, impl.plugin_name, result)
        return result

    def descriptors(self, family: str) -> list[Descriptor]:
        hook = getattr(self.pm.hook, hookspecs.FAMILIES[family])
        out: list[Descriptor] = []
        for impl in hook.get_hookimpls():
            result = self._call(impl)
            for d in result or []:
                if d.family != family:
                    raise SelectionError(
                        f"plugin {impl.plugin_name} returned a {d.family!r} descriptor from the {family} hook"
                    )
                out.append(d if d.plugin else _with_plugin(d, impl.plugin_name))
        return out

    def detect_platform(self, device: str | None = None) -> PlatformSpec:
        """Exactly one non-CPU claim wins; two are an error; none means the host CPU. ``device``: where
        the engine was told to run; ``"cpu"`` means the host CPU whatever GPU the machine has, so
        that no GPU kernel is selected for tensors on the host."""
        claims = self._claims()
        if device is not None and device.split(":")[0] == "cpu":
            claims = [(n, s) for n, s in claims if s.vendor == "cpu"]
        gpus = [(n, s) for n, s in claims if s.vendor != "cpu"]
        if len(gpus) > 1:
            names = ", ".join(f"{n} ({s.summary()})" for n, s in gpus)
            raise SelectionError(f"more than one plugin claims this machine: {names}")
        if gpus:
            return gpus[0][1]
        cpus = [s for _, s in claims]
        return cpus[0] if cpus else CPU_PLATFORM

    def _claims(self) -> list[tuple[str, PlatformSpec]]:
        """(plugin, platform) of each plugin that claims this machine; a failing detection is logged."""
        claims = []
        for impl in self.pm.hook.engine_detect_platform.get_hookimpls():
            try:
                spec = self._call(impl)
            except Exception as exc:
                logger.warning("platform detection in plugin %s failed: %s", impl.plugin_name, exc)
                continue
            if spec is not None:
                claims.append((impl.plugin_name, spec))
        return claims

    def select(self, family: str, ctx: SelectionContext, requested: str | None = None) -> Selection:
        return select(family, self.descriptors(family), ctx, requested)


def _with_plugin(d: Descriptor, plugin: str) -> Descriptor:
    return Descriptor(d.family, d.name, d.create, d.priority, d.check, plugin)


def _allowlist() -> set[str] | None:
    raw = os.environ.get("ENGINE_PLUGINS")
    if raw is None:
        return None
    return {p.strip() for p in raw.split(",") if p.strip()}


def load_plugins(extra: list[Any] | None = None, entry_points: bool = True) -> Plugins:
    """Build a plugin manager: hook specs, entry-point plugins (allowlist honoured), ``extra``.

    A broken plugin is logged and skipped; a misspelled hook implementation fails here
    (``check_pending``), not later.
    """
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    pm.register(catalogue, name="builtin-models")  # the built-in architectures, whatever ENGINE_PLUGINS selects
    allow = _allowlist()
    discovered: list[PluginInfo] = []
    if entry_points:
        found = sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name)
        unknown = sorted((allow or set()) - {ep.name for ep in found})
        if unknown:
            logger.warning("ENGINE_PLUGINS names plugins that are not installed: %s", ", ".join(unknown))
        for ep in found:
            dist = ep.dist.name if ep.dist is not None else "?"
            if allow is not None and ep.name not in allow:
                discovered.append(PluginInfo(ep.name, ep.value, dist, False, "not in ENGINE_PLUGINS"))
                continue
            if pm.has_plugin(ep.name):
                continue
            try:
                module = ep.load()
                pm.register(module, name=ep.name)
                discovered.append(PluginInfo(ep.name, ep.value, dist, True))
            except Exception as exc:
                logger.warning("plugin %s (%s) failed to load: %s", ep.name, ep.value, exc)
                discovered.append(PluginInfo(ep.name, ep.value, dist, False, f"{type(exc).__name__}: {exc}"))
    for i, plugin in enumerate(extra or []):
        pm.register(plugin, name=getattr(plugin, "__name__", f"extra-{i}"))
    pm.check_pending()
    trace = os.environ.get("ENGINE_TRACE_PLUGINS") == "1"
    if trace:
        pm.add_hookcall_monitoring(
            lambda name, impls, kw: logger.info("hook %s -> %s", name, [i.plugin_name for i in impls]),
            lambda outcome, name, impls, kw: None,
        )
    logger.debug("plugins loaded: %s", [p.name for p in discovered if p.loaded])
    return Plugins(pm, discovered, trace)
