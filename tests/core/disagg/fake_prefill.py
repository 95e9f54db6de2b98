"""A prefill engine's bootstrap port played by hand: it speaks the tcp transport's frames, then
misbehaves as a test asks (dies mid-page, sends a corrupt page)."""

from __future__ import annotations

import socket
import threading

from engine.core.native import kv_tcp


class FakePrefill:
    """Answers one fetch with ``pages`` (bytes) under ``checksums``, cut after ``cut`` bytes of the page data."""

    def __init__(self, key: bytes, pages: list[bytes], checksums: list[bytes], cut: int | None = None) -> None:
        self.key, self.pages, self.checksums, self.cut = key, pages, checksums, cut
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        conn, _ = self.server.accept()
        with conn:
            head = kv_tcp._recv_exact(conn, kv_tcp.FETCH.size + kv_tcp.TAG_BYTES)[:kv_tcp.FETCH.size]
            room = kv_tcp.FETCH.unpack(head)[2]
            reply = kv_tcp.REPLY.pack(kv_tcp.MAGIC, kv_tcp.KIND_REPLY, kv_tcp.OK, room, len(self.pages))
            out, headers = bytearray(reply + kv_tcp._tag(self.key, reply)), []
            for page, checksum in zip(self.pages, self.checksums):
                headers.append(kv_tcp.PAGE.pack(len(page), checksum))
                out += headers[-1] + page
            out += kv_tcp._tag(self.key, reply, *headers)
            if self.cut is not None:
                out = out[:len(reply) + kv_tcp.TAG_BYTES + kv_tcp.PAGE.size + self.cut]
            conn.sendall(out)  # then the connection closes: the process died
        self.server.close()
