"""The ``tcp`` KV transport: the reference transport, for any two machines (or processes) with TCP.

The prefill engine listens on its bootstrap port; a decode engine connects, asks for a room, and
reads the pages back over the same connection. Frames are fixed binary structs (``struct``, network
byte order); nothing read from a socket is unpickled or evaluated. Both directions carry an
HMAC-SHA256 under the engines' shared secret: the request over its fields, the reply over its
header and then over every page header (size and checksum), so a page that arrives is the page
its checksum names and the checksum is the peer's. Every size is bounded before anything is read:
the decode side knows each page's size from its own layout and refuses any other.

Request  (decode -> prefill): FETCH header (with the leading pages it holds already), tag.
Reply    (prefill -> decode): REPLY header, tag; then, when OK, per page a PAGE header and its
bytes, and a tag over the reply header and all page headers; otherwise a REASON and its text.

Other transports keep this control plane (rooms, the request, refusals, the timeout) and move the
pages their own way by overriding ``_send_pages`` and ``_receive_pages`` (kv_staged.py for those that
move a staged buffer with a transfer library; backends/cuda/kv_ipc.py).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import socket
import struct
import threading
import time
from typing import Any

from ..disagg.payload import checked
from ..families.kv_transport import (Fetch, KVExpectation, KVPayload, KVPeer, KVTransport, Offer, TransferStatus)

logger = logging.getLogger(__name__)

MAGIC = b"EKV1"
KIND_FETCH, KIND_REPLY = 1, 2
OK, UNKNOWN_ROOM, MISMATCH, ABORTED, BAD_AUTH = range(5)
# magic, kind, room, num_tokens, num_pages (to send), token digest, layout, first page (the pages before it stay)
FETCH = struct.Struct("!4sBQII16s16sI")
REPLY = struct.Struct("!4sBBQI")  # magic, kind, status, room, num_pages
PAGE = struct.Struct("!I16s")  # size, checksum
REASON = struct.Struct("!H")
TAG_BYTES = 32
MAX_REASON = 1024
MAX_CONNECTIONS = 64
CONNECT_TIMEOUT_S = 5.0
IO_TIMEOUT_S = 30.0  # between bytes, once a reply has started


def _tag(key: bytes, *parts: bytes) -> bytes:
    mac = hmac.new(key, digestmod=hashlib.sha256)
    for p in parts:
        mac.update(p)
    return mac.digest()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError(f"the peer closed the connection after {got} of {n} bytes")
        got += k
    return bytes(buf)


def staged_checksums(headers: list[bytes], sizes: list[int]) -> list[bytes]:
    """For a transport that moves the pages as one staged buffer: the page headers' checksums, each
    page of the size this engine expects."""
    checksums = []
    for header, size in zip(headers, sizes):
        got, checksum = PAGE.unpack(header)
        if got != size:
            raise ValueError(f"a page of {got} bytes; this engine's pages are {size}")
        checksums.append(checksum)
    return checksums


def split_pages(data: bytes, sizes: list[int]) -> list[bytes]:
    """A staged buffer's pages, in order."""
    pages, at = [], 0
    for n in sizes:
        pages.append(data[at:at + n])
        at += n
    return pages


class _Offer(Offer):
    def __init__(self, room: int, timeout: float, cond: threading.Condition, rooms: dict) -> None:
        self.room, self._cond, self._rooms, self.timeout = room, cond, rooms, timeout
        self.deadline = float("inf")  # set when its pages are published (or it is withdrawn)
        self.payload: KVPayload | None = None
        self.taken = False  # a decode engine is reading it
        self._status, self._error = TransferStatus.PENDING, None

    def publish(self, payload: KVPayload) -> None:
        with self._cond:
            if self._status is TransferStatus.PENDING:
                self.payload = payload
                self.deadline = time.monotonic() + self.timeout
                self._cond.notify_all()

    def status(self) -> TransferStatus:
        with self._cond:
            if self._status is TransferStatus.PENDING and time.monotonic() > self.deadline and not self.taken:
                self._end(TransferStatus.FAILED, "no decode engine fetched the room in time")
            return self._status

    @property
    def error(self) -> str | None:
        return self._error

    def cancel(self) -> None:
        """The room stays known until its deadline, so a decode engine asking for it hears at once."""
        with self._cond:
            if self._status is TransferStatus.PENDING and not self.taken:
                self.deadline = time.monotonic() + self.timeout
                self._end(TransferStatus.FAILED, "the request was aborted", forget=False)

    def _end(self, status: TransferStatus, error: str | None = None, forget: bool = True) -> None:
        """Under the lock: final state; the pages are dropped and (with ``forget``) the room."""
        self._status, self._error, self.payload = status, error, None
        if forget and self._rooms.get(self.room) is self:
            del self._rooms[self.room]
        self._cond.notify_all()


class _Fetch(Fetch):
    def __init__(self, transport: TcpTransport, peer: KVPeer, expect: KVExpectation) -> None:
        self.transport, self.peer, self.expect = transport, peer, expect
        self.key, self.timeout, self.progress = transport.key, transport.timeout, transport._progress
        self._status, self._error, self._payload = TransferStatus.PENDING, None, None
        self._sock: socket.socket | None = None
        self._cancelled = False
        threading.Thread(target=self._run, name=f"kv-fetch-{peer.room}", daemon=True).start()

    def status(self) -> TransferStatus:
        return self._status

    @property
    def error(self) -> str | None:
        return self._error

    def payload(self) -> KVPayload:
        if self._status is not TransferStatus.DONE:
            raise RuntimeError(f"the transfer is {self._status.value}")
        return self._payload

    def cancel(self) -> None:
        self._cancelled = True
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _run(self) -> None:
        try:
            payload = self._receive()
            why = checked(payload, self.expect)
            if why is not None:
                raise ValueError(why)
            self._payload, self._status = payload, TransferStatus.DONE
        except Exception as exc:  # every failure ends the transfer; the engine fails the request
            what = "cancelled" if self._cancelled else f"{type(exc).__name__}: {exc}"
            self._error = f"KV transfer from {self.peer.host}:{self.peer.port} room {self.peer.room} failed: {what}"
            self._status = TransferStatus.FAILED
        finally:
            if self._sock is not None:
                self._sock.close()
            self.progress.set()

    def _receive(self) -> KVPayload:
        e, p = self.expect, self.peer
        self._sock = sock = socket.create_connection((p.host, p.port), timeout=CONNECT_TIMEOUT_S)
        head = FETCH.pack(MAGIC, KIND_FETCH, p.room, e.num_tokens, len(e.page_sizes), e.token_digest, e.layout,
                          e.first_page)
        sock.sendall(head + _tag(self.key, head))
        # the prefill engine may still be computing the prompt; it answers within its own timeout
        sock.settimeout(self.timeout + CONNECT_TIMEOUT_S)
        reply = _recv_exact(sock, REPLY.size)
        if not hmac.compare_digest(_recv_exact(sock, TAG_BYTES), _tag(self.key, reply)):
            raise ValueError("the reply is not authenticated (another secret?)")
        magic, kind, status, room, num_pages = REPLY.unpack(reply)
        if (magic, kind, room) != (MAGIC, KIND_REPLY, p.room):
            raise ValueError("a malformed reply")
        sock.settimeout(IO_TIMEOUT_S)
        if status != OK:
            (length,) = REASON.unpack(_recv_exact(sock, REASON.size))
            reason = _recv_exact(sock, min(length, MAX_REASON)).decode("utf-8", "replace")
            raise ValueError(f"the prefill engine refused (status {status}): {reason}")
        if num_pages != len(e.page_sizes):
            raise ValueError(f"{num_pages} pages offered, {len(e.page_sizes)} expected")
        pages, checksums = self.transport._receive_pages(sock, reply, e.page_sizes)
        return KVPayload(e.num_tokens, e.token_digest, e.layout, pages, checksums, e.first_page)


class TcpTransport(KVTransport):
    name = "tcp"

    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        cfg = ctx.engine_config.disaggregation
        self.key = cfg.secret.encode()
        self.timeout = cfg.timeout
        self._progress = threading.Event()
        self._cond = threading.Condition()
        self._rooms: dict[int, _Offer] = {}
        self._listener: socket.socket | None = None
        self._closed = False
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        if cfg.mode == "prefill":
            self._listener = socket.create_server((cfg.bootstrap_host, cfg.bootstrap_port))
            self._listener.settimeout(1.0)
            threading.Thread(target=self._accept, name="kv-bootstrap", daemon=True).start()
            logger.info("KV bootstrap server on %s:%d", cfg.bootstrap_host, self.bootstrap_port)

    @property
    def bootstrap_port(self) -> int | None:
        return self._listener.getsockname()[1] if self._listener is not None else None

    def offer(self, room: int) -> Offer:
        with self._cond:
            if room in self._rooms:
                raise ValueError(f"room {room} is in use")
            offer = self._rooms[room] = _Offer(room, self.timeout, self._cond, self._rooms)
            self._cond.notify_all()
        return offer

    def fetch(self, peer: KVPeer, expect: KVExpectation) -> Fetch:
        return _Fetch(self, peer, expect)

    def wait(self, timeout: float) -> None:
        if self._progress.wait(timeout):
            self._progress.clear()

    def close(self) -> None:
        self._closed = True
        if self._listener is not None:
            self._listener.close()

    # -- the prefill side's server ---------------------------------------------------------

    def _accept(self) -> None:
        while not self._closed:
            self._reap()
            try:
                conn, _ = self._listener.accept()
            except (socket.timeout, TimeoutError):
                continue
            except OSError:
                return
            if not self._slots.acquire(blocking=False):
                conn.close()  # too many fetches at once: the decode engine fails this transfer
                continue
            threading.Thread(target=self._serve, args=(conn,), name="kv-serve", daemon=True).start()

    def _reap(self) -> None:
        """Drop the rooms past their deadline: unfetched pages, and aborted rooms kept to say so."""
        now = time.monotonic()
        with self._cond:
            for offer in list(self._rooms.values()):
                if offer.status() is not TransferStatus.PENDING and now > offer.deadline \
                        and self._rooms.get(offer.room) is offer:
                    del self._rooms[offer.room]

    def _serve(self, conn: socket.socket) -> None:
        offer = None
        try:
            conn.settimeout(IO_TIMEOUT_S)
            if not conn.recv(1, socket.MSG_PEEK):
                return  # connected and closed: a probe of the port (the gateway's, at registration)
            head = _recv_exact(conn, FETCH.size)
            tag = _recv_exact(conn, TAG_BYTES)
            magic, kind, room, num_tokens, num_pages, digest, layout, first_page = FETCH.unpack(head)
            if (magic, kind) != (MAGIC, KIND_FETCH):
                return  # not ours: say nothing
            if not hmac.compare_digest(tag, _tag(self.key, head)):
                return self._refuse(conn, room, BAD_AUTH, "the request is not authenticated")
            offer = self._claim(room)
            if offer is None:
                return self._refuse(conn, room, UNKNOWN_ROOM, f"no request in room {room} here")
            payload = offer.payload
            if payload is None:
                return self._refuse(conn, room, ABORTED, "the request was aborted")
            if (num_tokens, digest, layout, first_page + num_pages) != \
                    (payload.num_tokens, payload.token_digest, payload.layout, len(payload.pages)):
                with self._cond:
                    offer.taken = False  # the real decode engine may still come for it
                return self._refuse(conn, room, MISMATCH, "another prompt or page layout")
            self._send(conn, room, payload.from_page(first_page))
            with self._cond:
                offer._end(TransferStatus.DONE)
        except Exception as exc:
            logger.warning("a KV fetch failed: %s: %s", type(exc).__name__, exc)
            with self._cond:
                if offer is not None and offer.taken and offer._status is TransferStatus.PENDING:
                    offer._end(TransferStatus.FAILED, f"sending failed: {exc}")
        finally:
            conn.close()
            self._slots.release()

    def _claim(self, room: int) -> _Offer | None:
        """The room's offer once its pages are published (or it ended), waiting up to the timeout."""
        deadline = time.monotonic() + self.timeout
        with self._cond:
            while True:
                offer = self._rooms.get(room)
                if offer is not None and not offer.taken and (offer.payload is not None
                                                              or offer._status is not TransferStatus.PENDING):
                    offer.taken = offer._status is TransferStatus.PENDING
                    return offer
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    return None
                self._cond.wait(min(left, 1.0))

    def _refuse(self, conn: socket.socket, room: int, status: int, reason: str) -> None:
        head = REPLY.pack(MAGIC, KIND_REPLY, status, room, 0)
        text = reason.encode()[:MAX_REASON]
        conn.sendall(head + _tag(self.key, head) + REASON.pack(len(text)) + text)

    def _send(self, conn: socket.socket, room: int, payload: KVPayload) -> None:
        head = REPLY.pack(MAGIC, KIND_REPLY, OK, room, len(payload.pages))
        conn.sendall(head + _tag(self.key, head))
        self._send_pages(conn, head, payload)

    # -- how the pages move (another transport overrides these two) -------------------------

    def _send_pages(self, conn: socket.socket, head: bytes, payload: KVPayload) -> None:
        """Prefill side, after the OK reply ``head``: every page of ``payload`` to the fetcher."""
        headers = []
        for page, checksum in zip(payload.pages, payload.checksums):
            header = PAGE.pack(len(page), checksum)
            headers.append(header)
            conn.sendall(header)
            conn.sendall(page)
        conn.sendall(_tag(self.key, head, *headers))

    def _receive_pages(self, sock: socket.socket, reply: bytes, sizes: list[int]) -> tuple[list[bytes], list[bytes]]:
        """Decode side, after the OK ``reply``: the pages (each of its expected size) and their checksums."""
        headers, pages, checksums = [], [], []
        for size in sizes:
            header = _recv_exact(sock, PAGE.size)
            got, checksum = PAGE.unpack(header)
            if got != size:
                raise ValueError(f"a page of {got} bytes; this engine's pages are {size}")
            headers.append(header)
            pages.append(_recv_exact(sock, size))
            checksums.append(checksum)
        if not hmac.compare_digest(_recv_exact(sock, TAG_BYTES), _tag(self.key, reply, *headers)):
            raise ValueError("the pages' headers are not authenticated")
        return pages, checksums
