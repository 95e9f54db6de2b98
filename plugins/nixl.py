"""NIXL as a storage tier (L3): the file tier's records moved by NIXL. The plugin registers NIXL's
KV transport too (nixl_kv.py).

NIXL (``pip install nixl``) moves bytes between registered memory and storage through plugins.
By default its file plugins (the first of GDS_MT, GDS, 3FS and POSIX that starts here) write and
read a directory the way the ``file`` tier lays it out (core/tiers/file.py: one record per content
key, written to a temporary name and renamed), so engines using either share one directory. Asked
for (``plugin_options["nixl"]["plugin"]`` or NIXL_STORAGE_PLUGIN ``OBJ``), its object plugin keeps
the records as objects in an S3 bucket instead (nixl_obj.py). Refused, with the reason, where the
package is missing, or no directory (no endpoint or bucket, for OBJ) is named.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from ..core.hookspecs import hookimpl
from ..core.registry import Descriptor
from ..core.tiers.file import FileTier, file_reasons
from .nixl_kv import engine_register_kv_transports  # noqa: F401  (the nixl KV transport: one plugin for NIXL)
from .nixl_obj import NixlObjectTier, nixl_options, object_reasons, object_settings
from .nixl_store import NixlStore

FILE_PLUGINS = ("GDS_MT", "GDS", "3FS", "POSIX")  # preferred first, where NIXL offers them


def nixl_reasons(ctx) -> list[str]:
    reasons = [] if importlib.util.find_spec("nixl") is not None else \
        ["the nixl package is not installed (pip install nixl)"]
    if object_settings(ctx)["plugin"]:
        return reasons + object_reasons(ctx)
    if nixl_options(ctx):  # the object store's settings, given where the file plugins serve
        reasons.append(f'plugin_options["nixl"] sets {", ".join(nixl_options(ctx))} without "plugin": "OBJ"')
    return reasons + file_reasons(ctx)


class NixlFileTier(FileTier):
    name = "nixl"

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.store = NixlStore(FILE_PLUGINS)
        self.plugin = self.store.plugin

    def _write(self, fd: int, parts: list) -> None:
        try:
            self.store.write(parts, "FILE", fd)
        finally:
            os.close(fd)

    def _read_many(self, paths: list[Path]) -> list:
        """The files read by NIXL in one transfer (a descriptor each) into one buffer the records
        then lie over (no copy after); an absent file is its OSError. Where the transfer fails, each
        file is read alone, so one bad file fails only itself."""
        import torch

        out: list = []
        fds: list[tuple[int, int]] = []  # (index in out, descriptor)
        try:
            for path in paths:
                try:
                    fds.append((len(out), os.open(path, os.O_RDONLY)))
                    out.append(None)
                except OSError as exc:
                    out.append(exc)
            sizes = [os.fstat(fd).st_size for _, fd in fds]
            buffer = torch.empty(sum(sizes), dtype=torch.uint8)
            regions, at = [], 0
            for (i, fd), size in zip(fds, sizes):
                out[i] = buffer[at:at + size].numpy()
                if size:
                    regions.append((at, size, fd, ""))
                at += size
            if regions:
                self.store.transfer("READ", buffer, "FILE", regions)
            return out
        except OSError as exc:
            if len(paths) == 1:
                return [exc]
        finally:
            for _, fd in fds:
                os.close(fd)
        return [self._read_many([p])[0] for p in paths]


def create(ctx):
    return NixlObjectTier(ctx) if object_settings(ctx)["plugin"] else NixlFileTier(ctx)


@hookimpl
def engine_register_cache_tiers() -> list[Descriptor]:
    return [Descriptor("cache_tier", "nixl", create, check=nixl_reasons)]
