"""The ``nixl`` KV transport (``--disaggregation-transfer-backend nixl``): pages moved by NIXL.

NIXL (``pip install 'engine[nixl]'``) moves bytes between registered memory of two agents through
its backends; this transport uses UCX, which runs on host memory over shared memory or TCP on any
machine and over RDMA or NVLink where the hardware has them. The control plane is the tcp
transport's (core/native/kv_tcp.py: rooms, the authenticated request and reply, refusals, the
timeout, loopback binds); only the pages move another way:

- the prefill engine stages the pages it sends in one buffer, registers it with its NIXL agent and
  answers the fetch with its agent's metadata, the buffer's address and length and each page's
  size and checksum, all under the HMAC of the shared secret;
- the decode engine loads that metadata, registers a buffer of its own, READs the pages into it
  in one NIXL transfer and says so (an authenticated DONE), after which the prefill engine
  deregisters its buffer; the checksums are checked as for any transport (payload.checked).

Nothing of NIXL's metadata is interpreted here beyond handing it to NIXL; its size is bounded
before it is read. Both sides stage through host buffers: the pages are not read from or written
into the KV cache's own memory by NIXL (that would skip the checksums before the cache is written).
Refused, with the reason, where the nixl package is missing or offers no UCX backend. Registered
by the ``nixl`` plugin (plugins/nixl.py imports its hook).
"""

from __future__ import annotations

import hmac
import importlib.util
import socket
import struct
import threading
import time
import uuid

from ..core.hookspecs import hookimpl
from ..core.native.kv_tcp import (IO_TIMEOUT_S, PAGE, TAG_BYTES, TcpTransport, _recv_exact, _tag, split_pages,
                                  staged_checksums)
from ..core.registry import Descriptor

DESC = struct.Struct("!IQQ")  # agent metadata length, staged buffer address, its length
MAX_METADATA = 1 << 20
DONE = b"EKVD"  # the decode engine read the pages
POLL_S = 0.0005


def nixl_kv_reasons(ctx) -> list[str]:
    if importlib.util.find_spec("nixl") is None:
        return ["the nixl package is not installed (pip install 'engine[nixl]')"]
    return []


class NixlTransport(TcpTransport):
    name = "nixl"

    def __init__(self, ctx) -> None:
        from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

        self.agent = nixl_agent(f"engine-kv-{uuid.uuid4().hex}", nixl_agent_config(
            backends=["UCX"], sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT))
        if "UCX" not in self.agent.backends:
            raise RuntimeError(f"NIXL offers no UCX backend here; its plugins are {self.agent.get_plugin_list()}")
        self._peers = threading.Lock()  # loading a peer's metadata, then reading with it
        super().__init__(ctx)

    def _send_pages(self, conn: socket.socket, head: bytes, payload) -> None:
        import torch

        total = sum(len(p) for p in payload.pages)
        staged = torch.empty(max(total, 1), dtype=torch.uint8)
        offset = 0
        for page in payload.pages:
            staged[offset:offset + len(page)] = torch.frombuffer(bytearray(page), dtype=torch.uint8)
            offset += len(page)
        registered = self.agent.register_memory(staged)
        try:
            metadata = self.agent.get_agent_metadata()
            desc = DESC.pack(len(metadata), staged.data_ptr(), total)
            headers = [PAGE.pack(len(p), c) for p, c in zip(payload.pages, payload.checksums)]
            conn.sendall(desc + metadata + b"".join(headers) + _tag(self.key, head, desc, metadata, *headers))
            conn.settimeout(IO_TIMEOUT_S)
            done = _recv_exact(conn, len(DONE) + TAG_BYTES)
            if not hmac.compare_digest(done, DONE + _tag(self.key, head, DONE)):
                raise ValueError("the decode engine did not confirm reading the pages")
        finally:
            self.agent.deregister_memory(registered)

    def _receive_pages(self, sock: socket.socket, reply: bytes, sizes: list[int]) -> tuple[list[bytes], list[bytes]]:
        import torch

        desc = _recv_exact(sock, DESC.size)
        length, address, total = DESC.unpack(desc)
        if length > MAX_METADATA:
            raise ValueError(f"{length} bytes of NIXL metadata (at most {MAX_METADATA})")
        if total != sum(sizes):
            raise ValueError(f"pages of {total} bytes in all; this engine's pages are {sum(sizes)}")
        metadata = _recv_exact(sock, length)
        headers = [_recv_exact(sock, PAGE.size) for _ in sizes]
        if not hmac.compare_digest(_recv_exact(sock, TAG_BYTES), _tag(self.key, reply, desc, metadata, *headers)):
            raise ValueError("the pages' descriptors are not authenticated")
        checksums = staged_checksums(headers, sizes)
        buffer = torch.empty(max(total, 1), dtype=torch.uint8)
        if total:
            self._read(metadata, address, buffer, total)
        sock.sendall(DONE + _tag(self.key, reply, DONE))
        return split_pages(buffer.numpy().tobytes(), sizes), checksums

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
