"""A NIXL agent with one storage plugin started, moving bytes between host buffers and storage:
files (GDS_MT, GDS, 3FS, POSIX; nixl.py) or objects in an S3 bucket (OBJ; nixl_obj.py).

The storage tier uses it from two threads (the storage writer's and the prefetcher's), so the
agent serialises its own calls (NIXL_THREAD_SYNC_STRICT).
"""

from __future__ import annotations

import itertools
import os


class NixlStore:
    def __init__(self, candidates: tuple[str, ...], params: dict[str, str] | None = None) -> None:
        """The first of ``candidates`` that NIXL lists and starts here (with ``params``);
        RuntimeError saying what NIXL offers and why each listed one did not start."""
        from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

        self.agent = nixl_agent(f"engine-hicache-{os.getpid()}", nixl_agent_config(
            backends=[], sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT))
        self._devices = itertools.count(1)  # an object's registration names a device id of its own
        offered = self.agent.get_plugin_list()
        self.plugin, refused = None, []
        for name in (p for p in candidates if p in offered):
            try:  # a plugin NIXL lists may still not start here (GDS without cuFile, a library it needs missing)
                self.agent.create_backend(name, params or {})
            except Exception as exc:
                refused.append(f"{name}: {type(exc).__name__} {exc}")
                continue
            self.plugin = name
            break
        if self.plugin is None:
            import nixl

            raise RuntimeError(f"NIXL ({nixl._api.__name__.split('.')[0]}) starts none of {', '.join(candidates)}; "
                               f"it lists {offered}" + (f", refused {'; '.join(refused)}" if refused else "")
                               + " (NIXL_LOG_LEVEL=DEBUG logs why a plugin's library does not load)")

    def transfer(self, op: str, buffer, mem_type: str, size: int, device: int | None = None, meta: str = "") -> None:
        """One transfer (``op`` READ or WRITE) between ``buffer`` (a host uint8 tensor) and ``size``
        bytes of storage: a file (``mem_type`` FILE, ``device`` its descriptor) or an object
        (OBJ, ``meta`` its key). OSError where NIXL fails it."""
        device = next(self._devices) if device is None else device
        mem = self.agent.register_memory(buffer)
        try:
            remote = self.agent.register_memory([(0, size, device, meta)], mem_type)
        except Exception as exc:
            self.agent.deregister_memory(mem)
            raise OSError(f"NIXL {self.plugin} registering {meta or device}: {exc}") from None
        handle = None
        try:
            local = self.agent.get_xfer_descs(buffer)
            handle = self.agent.initialize_xfer(op, local, self.agent.get_xfer_descs([(0, size, device)], mem_type),
                                                self.agent.name)
            state = self.agent.transfer(handle)
            while state not in ("DONE", "ERR"):
                state = self.agent.check_xfer_state(handle)
        except Exception as exc:  # NIXL raises where the plugin reports an error (an absent object, a refused write)
            state = f"ERR ({type(exc).__name__} {exc})"
        finally:
            if handle is not None:
                self.agent.release_xfer_handle(handle)
            self.agent.deregister_memory(remote)
            self.agent.deregister_memory(mem)
        if state != "DONE":
            raise OSError(f"NIXL {self.plugin} {op} of {size} bytes ({meta or 'file'}) failed: {state}")

    def write(self, parts: list, mem_type: str, device: int | None = None, meta: str = "") -> None:
        """``parts`` (buffers, in order) gathered into one buffer NIXL registers (the one copy), written."""
        import numpy as np
        import torch

        views = [memoryview(p).cast("B") for p in parts]
        buffer = torch.empty(sum(len(v) for v in views), dtype=torch.uint8)
        out, at = buffer.numpy(), 0
        for v in views:
            out[at:at + len(v)] = np.frombuffer(v, dtype=np.uint8)
            at += len(v)
        self.transfer("WRITE", buffer, mem_type, at, device, meta)
