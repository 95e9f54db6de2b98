"""A NIXL agent with one storage plugin started, moving bytes between host buffers and storage:
files (GDS_MT, GDS, 3FS, POSIX; nixl.py) or objects in an S3 bucket (OBJ; nixl_obj.py).

The storage tier uses it from several threads (the storage writer's, the prefetcher's), so the
agent serialises its own calls (NIXL_THREAD_SYNC_STRICT). A transfer request carries many
descriptors (a run of records); a plugin runs its own on its own threads (the OBJ plugin on a
pool sized by the CPU count), so a tier may post requests on several agents to run side by side.
"""

from __future__ import annotations

import itertools
import os


AGENTS = itertools.count()  # a process's agents each have a name of their own


class NixlStore:
    def __init__(self, candidates: tuple[str, ...], params: dict[str, str] | None = None) -> None:
        """The first of ``candidates`` that NIXL lists and starts here (with ``params``);
        RuntimeError saying what NIXL offers and why each listed one did not start."""
        from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

        self.agent = nixl_agent(f"engine-hicache-{os.getpid()}-{next(AGENTS)}", nixl_agent_config(
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

    def transfer(self, op: str, buffer, mem_type: str, regions: list[tuple[int, int, int | None, str]]) -> None:
        """One transfer request (``op`` READ or WRITE) between ``buffer`` (a host uint8 tensor) and
        storage, a descriptor per region: (offset in ``buffer``, bytes, device, meta), each a file
        (``mem_type`` FILE, ``device`` its descriptor) or an object (OBJ, ``meta`` its key; ``device``
        None). OSError where NIXL fails any of them."""
        self.post(op, buffer, mem_type, regions).wait()

    def post(self, op: str, buffer, mem_type: str, regions: list[tuple[int, int, int | None, str]]) -> Posted:
        """``transfer``'s request, started and not waited for (``wait()`` ends it): several agents'
        requests posted together run side by side."""
        remotes = [(0, size, next(self._devices) if device is None else device, meta)
                   for _, size, device, meta in regions]
        what = f"{len(regions)} {mem_type} regions" if len(regions) > 1 else (regions[0][3] or "file")
        posted = Posted(self, f"{op} of {sum(r[1] for r in regions)} bytes ({what})")
        posted.registered.append(self.agent.register_memory(buffer))
        try:
            posted.registered.append(self.agent.register_memory(remotes, mem_type))
            local = self.agent.get_xfer_descs([buffer[at:at + size] for at, size, _, _ in regions])
            posted.handle = self.agent.initialize_xfer(
                op, local, self.agent.get_xfer_descs([r[:3] for r in remotes], mem_type), self.agent.name)
            posted.state = self.agent.transfer(posted.handle)
        except Exception as exc:  # NIXL raises where the plugin reports an error (an absent object, a refused write)
            posted.state = f"ERR ({type(exc).__name__} {exc})"
        return posted

    def write(self, parts: list, mem_type: str, device: int | None = None, meta: str = "") -> None:
        """``parts`` (buffers, in order) gathered into one buffer NIXL registers (the one copy), written."""
        buffer, [(at, size)] = gather([parts])
        self.transfer("WRITE", buffer, mem_type, [(at, size, device, meta)])


def gather(blobs: list[list]) -> tuple:
    """Each blob's parts (buffers, in order) copied one after another into one host uint8 tensor NIXL
    can register (the one copy on the way out); the tensor and each blob's (offset, bytes) in it."""
    import numpy as np
    import torch

    views = [[memoryview(p).cast("B") for p in parts] for parts in blobs]
    buffer = torch.empty(sum(len(v) for parts in views for v in parts), dtype=torch.uint8)
    out, at, spans = buffer.numpy(), 0, []
    for parts in views:
        start = at
        for v in parts:
            out[at:at + len(v)] = np.frombuffer(v, dtype=np.uint8)
            at += len(v)
        spans.append((start, at - start))
    return buffer, spans


class Posted:
    """A transfer request on its way; ``wait()`` once."""

    def __init__(self, store: NixlStore, what: str) -> None:
        self.store, self.what = store, what
        self.registered: list = []  # what to deregister when it ends
        self.handle = None
        self.state = "ERR"

    def wait(self) -> None:
        """Until it ends, its handle and registrations released; OSError where NIXL failed it."""
        agent, state = self.store.agent, self.state
        try:
            while state not in ("DONE", "ERR") and not state.startswith("ERR "):
                state = agent.check_xfer_state(self.handle)
        except Exception as exc:
            state = f"ERR ({type(exc).__name__} {exc})"
        finally:
            if self.handle is not None:
                agent.release_xfer_handle(self.handle)
            for reg in reversed(self.registered):
                agent.deregister_memory(reg)
        if state != "DONE":
            raise OSError(f"NIXL {self.store.plugin} {self.what} failed: {state}")
