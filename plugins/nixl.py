"""NIXL as a storage tier (L3): the file tier's records moved by a NIXL file plugin. The plugin
registers NIXL's KV transport too (nixl_kv.py).

NIXL (``pip install nixl``) moves bytes between registered memory and storage through plugins;
its file plugins (the first of GDS_MT, GDS, 3FS and POSIX that starts here) write and read a
directory the way the ``file`` tier lays it out (core/tiers/file.py: one record per content key,
written to a temporary name and renamed), so engines using either share one directory. Its
object plugin (OBJ, S3) is not wired yet. Refused, with the reason, where the package is missing
or no directory is named.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from ..core.hookspecs import hookimpl
from ..core.registry import Descriptor
from ..core.tiers.file import FileTier, file_reasons
from .nixl_kv import engine_register_kv_transports  # noqa: F401  (the nixl KV transport: one plugin for NIXL)

FILE_PLUGINS = ("GDS_MT", "GDS", "3FS", "POSIX")  # preferred first, where NIXL offers them


def nixl_reasons(ctx) -> list[str]:
    reasons = [] if importlib.util.find_spec("nixl") is not None else \
        ["the nixl package is not installed (pip install nixl)"]
    return reasons + file_reasons(ctx)


class NixlFileTier(FileTier):
    name = "nixl"

    def __init__(self, ctx) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        super().__init__(ctx)
        self.agent = nixl_agent(f"engine-hicache-{os.getpid()}", nixl_agent_config(backends=[]))
        offered = self.agent.get_plugin_list()
        self.plugin, refused = None, []
        for name in (p for p in FILE_PLUGINS if p in offered):
            try:  # a plugin NIXL lists may still not start here (GDS without cuFile, 3FS without its library)
                self.agent.create_backend(name)
            except Exception as exc:
                refused.append(f"{name}: {type(exc).__name__} {exc}")
                continue
            self.plugin = name
            break
        if self.plugin is None:
            raise RuntimeError(f"NIXL starts no file plugin ({', '.join(FILE_PLUGINS)}); it lists {offered}"
                               + (f", refused {'; '.join(refused)}" if refused else ""))

    def _transfer(self, op: str, buffer, fd: int, size: int) -> None:
        """One NIXL transfer between ``buffer`` (a host uint8 tensor) and ``size`` bytes of file ``fd``."""
        mem = self.agent.register_memory(buffer)
        files = self.agent.register_memory([(0, size, fd, "")], "FILE")
        try:
            local = self.agent.get_xfer_descs(buffer)
            remote = self.agent.get_xfer_descs([(0, size, fd)], "FILE")
            handle = self.agent.initialize_xfer(op, local, remote, self.agent.name)
            state = self.agent.transfer(handle)
            while state not in ("DONE", "ERR"):
                state = self.agent.check_xfer_state(handle)
            self.agent.release_xfer_handle(handle)
            if state == "ERR":
                raise OSError(f"NIXL {self.plugin} {op} of {size} bytes failed")
        finally:
            self.agent.deregister_memory(files)
            self.agent.deregister_memory(mem)

    def _write(self, fd: int, parts: list) -> None:
        """The parts gathered into one buffer NIXL registers (the one copy), written to ``fd``."""
        import numpy as np
        import torch

        try:
            views = [memoryview(p).cast("B") for p in parts]
            buffer = torch.empty(sum(len(v) for v in views), dtype=torch.uint8)
            out, at = buffer.numpy(), 0
            for v in views:
                out[at:at + len(v)] = np.frombuffer(v, dtype=np.uint8)
                at += len(v)
            self._transfer("WRITE", buffer, fd, at)
        finally:
            os.close(fd)

    def _read(self, path: Path):
        """The file read by NIXL into a buffer the record then lies over (no copy after)."""
        import torch

        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            buffer = torch.empty(size, dtype=torch.uint8)
            if size:
                self._transfer("READ", buffer, fd, size)
            return buffer.numpy()
        finally:
            os.close(fd)


@hookimpl
def engine_register_cache_tiers() -> list[Descriptor]:
    return [Descriptor("cache_tier", "nixl", lambda ctx: NixlFileTier(ctx), check=nixl_reasons)]
