"""The ``nixl`` KV transport (``--disaggregation-transfer-backend nixl``): pages moved by NIXL.

NIXL (``pip install 'engine[nixl]'``) moves bytes between registered memory of two agents through
its backends; this transport uses UCX, which runs on host memory over shared memory or TCP on any
machine and over RDMA or NVLink where the hardware has them. The control plane and the staging are
core/native/kv_staged.py's: the prefill engine registers its staged pages with its NIXL agent and
answers with the agent's metadata; the decode engine loads it and READs the pages in one NIXL
transfer. The staging is per transfer (a buffer registered, the metadata loaded again). Refused,
with the reason, where the nixl package is missing or offers no UCX backend. Registered by the
``nixl`` plugin (plugins/nixl.py imports its hook).
"""

from __future__ import annotations

import importlib.util
import threading
import time
import uuid

from ..core.hookspecs import hookimpl
from ..core.native.kv_staged import StagedTransport
from ..core.native.kv_tcp import IO_TIMEOUT_S
from ..core.registry import Descriptor

POLL_S = 0.0005


def nixl_kv_reasons(ctx) -> list[str]:
    if importlib.util.find_spec("nixl") is None:
        return ["the nixl package is not installed (pip install 'engine[nixl]')"]
    return []


class NixlTransport(StagedTransport):
    name, library = "nixl", "NIXL"

    def __init__(self, ctx) -> None:
        from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

        self.agent = nixl_agent(f"engine-kv-{uuid.uuid4().hex}", nixl_agent_config(
            backends=["UCX"], sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT))
        if "UCX" not in self.agent.backends:
            raise RuntimeError(f"NIXL offers no UCX backend here; its plugins are {self.agent.get_plugin_list()}")
        self._peers = threading.Lock()  # loading a peer's metadata, then reading with it
        super().__init__(ctx)

    def _expose(self, staged) -> tuple[bytes, object]:
        registered = self.agent.register_memory(staged)  # first: the agent's metadata describes it
        return self.agent.get_agent_metadata(), registered

    def _withdraw(self, exposed) -> None:
        self.agent.deregister_memory(exposed)

    def _read(self, metadata: bytes, address: int, buffer, total: int) -> None:
        """One NIXL READ of ``total`` bytes at the peer's ``address`` into ``buffer``."""
        registered = self.agent.register_memory(buffer)
        handle = None
        try:
            with self._peers:
                peer = self.agent.add_remote_agent(metadata)
                local = self.agent.get_xfer_descs([(buffer.data_ptr(), total, 0)], "DRAM")
                remote = self.agent.get_xfer_descs([(address, total, 0)], "DRAM")
                handle = self.agent.initialize_xfer("READ", local, remote, peer)
            state = self.agent.transfer(handle)
            deadline = time.monotonic() + IO_TIMEOUT_S
            while state == "PROC" and time.monotonic() < deadline:
                time.sleep(POLL_S)
                state = self.agent.check_xfer_state(handle)
            if state != "DONE":
                raise ConnectionError(f"the NIXL read of {total} bytes ended {state}")
        finally:
            if handle is not None:
                self.agent.release_xfer_handle(handle)
            self.agent.deregister_memory(registered)


@hookimpl
def engine_register_kv_transports() -> list[Descriptor]:
    return [Descriptor("kv_transport", "nixl", NixlTransport, check=nixl_kv_reasons)]
