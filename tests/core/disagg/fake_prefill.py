"""A prefill engine's bootstrap port played by hand: it speaks the tcp transport's frames, then
misbehaves as a test asks (dies mid-page, sends a corrupt page, refuses the room, answers with
something that is not the transport's)."""

from __future__ import annotations

import socket
import threading

from engine.core.native import kv_tcp


class FakePrefill:
    """Answers one fetch with ``pages`` (bytes) under ``checksums`` as ``fault`` says: "dies
    mid-page" (half of the first page, then the connection closes), "refuses" (the room is not
    here), "answers junk" (an HTTP answer); anything else sends the pages as they are."""

    def __init__(self, key: bytes, pages: list[bytes], checksums: list[bytes], fault: str) -> None:
        self.key, self.pages, self.checksums, self.fault = key, pages, checksums, fault
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        conn, _ = self.server.accept()
        with conn:
            head = kv_tcp._recv_exact(conn, kv_tcp.FETCH.size + kv_tcp.TAG_BYTES)[:kv_tcp.FETCH.size]
            conn.sendall(self._answer(kv_tcp.FETCH.unpack(head)[2]))  # then the connection closes
        self.server.close()

    def _answer(self, room: int) -> bytes:
        if self.fault == "answers junk":
            return b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n" + bytes(200)
        if self.fault == "refuses":
            reply = kv_tcp.REPLY.pack(kv_tcp.MAGIC, kv_tcp.KIND_REPLY, kv_tcp.UNKNOWN_ROOM, room, 0)
            reason = b"no request in room %d here" % room
            return reply + kv_tcp._tag(self.key, reply) + kv_tcp.REASON.pack(len(reason)) + reason
        reply = kv_tcp.REPLY.pack(kv_tcp.MAGIC, kv_tcp.KIND_REPLY, kv_tcp.OK, room, len(self.pages))
        out, headers = bytearray(reply + kv_tcp._tag(self.key, reply)), []
        for page, checksum in zip(self.pages, self.checksums):
            headers.append(kv_tcp.PAGE.pack(len(page), checksum))
            out += headers[-1] + page
        out += kv_tcp._tag(self.key, reply, *headers)
        if self.fault == "dies mid-page":
            out = out[:len(reply) + kv_tcp.TAG_BYTES + kv_tcp.PAGE.size + len(self.pages[0]) // 2]
        return bytes(out)
