"""KV transports whose pages move as one staged host buffer the decode engine reads with a
transfer library (plugins/nixl_kv.py: NIXL; plugins/mooncake_kv.py: Mooncake's Transfer Engine).

The control plane is the tcp transport's (kv_tcp.py: rooms, the authenticated request and reply,
refusals, the timeout, loopback binds); only the pages move another way:

- the prefill engine stages the pages it sends in one host buffer, exposes it to its library
  (registers it) and answers the fetch with the library's metadata (what a peer needs to reach the
  buffer), the buffer's address and length and each page's size and checksum, all under the HMAC
  of the shared secret;
- the decode engine checks that answer, reads the pages into a buffer of its own with the library
  and says so (an authenticated DONE), after which the prefill engine withdraws its buffer (at the
  latest ``read_timeout`` after the answer, DONE or not); the checksums are checked as for any
  transport (payload.checked).

Nothing of the library's metadata is interpreted here beyond handing it to the library; its size
is bounded before it is read. The libraries neither read from nor write into the KV cache itself:
the checksums are checked before the cache is written.
"""

from __future__ import annotations

import hmac
import socket
import struct
from typing import Any

from .kv_tcp import IO_TIMEOUT_S, PAGE, TAG_BYTES, TcpTransport, _recv_exact, _tag, split_pages, staged_checksums

DESC = struct.Struct("!IQQ")  # metadata length, staged buffer address, its length
DONE = b"EKVD"  # the decode engine read the pages


class StagedTransport(TcpTransport):
    library = ""  # its name, in errors
    max_metadata = 1 << 20
    read_timeout = IO_TIMEOUT_S  # how long the staged pages stay exposed for the decode engine to read

    # -- what a library provides -----------------------------------------------------------

    def _expose(self, staged) -> tuple[bytes, Any]:
        """Prefill side: ``staged`` (a host uint8 tensor) made readable by peers; the metadata a peer
        needs and what ``_withdraw`` takes."""
        raise NotImplementedError

    def _withdraw(self, exposed: Any) -> None:
        """Prefill side: the staged buffer no longer readable."""
        raise NotImplementedError

    def _read(self, metadata: bytes, address: int, buffer, total: int) -> None:
        """Decode side: ``total`` bytes at the peer's ``address`` read into ``buffer``, or an error."""
        raise NotImplementedError

    # -- the pages -------------------------------------------------------------------------

    def _send_pages(self, conn: socket.socket, head: bytes, payload) -> None:
        import torch

        total = sum(len(p) for p in payload.pages)
        staged = torch.frombuffer(bytearray(b"".join(payload.pages)) or bytearray(1), dtype=torch.uint8)
        metadata, exposed = self._expose(staged)
        try:
            desc = DESC.pack(len(metadata), staged.data_ptr(), total)
            headers = [PAGE.pack(len(p), c) for p, c in zip(payload.pages, payload.checksums)]
            conn.sendall(desc + metadata + b"".join(headers) + _tag(self.key, head, desc, metadata, *headers))
            conn.settimeout(self.read_timeout)
            done = _recv_exact(conn, len(DONE) + TAG_BYTES)
            if not hmac.compare_digest(done, DONE + _tag(self.key, head, DONE)):
                raise ValueError("the decode engine did not confirm reading the pages")
        finally:
            self._withdraw(exposed)

    def _receive_pages(self, sock: socket.socket, reply: bytes, sizes: list[int]) -> tuple[list[bytes], list[bytes]]:
        import torch

        desc = _recv_exact(sock, DESC.size)
        length, address, total = DESC.unpack(desc)
        if length > self.max_metadata:
            raise ValueError(f"{length} bytes of {self.library} metadata (at most {self.max_metadata})")
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
