"""Connections that cost the server without asking it anything: slow headers, slow bodies, floods.

uvicorn's HTTP/1.1 protocol, with two guards per connection:

- a connection must finish a request's headers within ``header_timeout`` of opening (or of its
  last response, on keep-alive): a slowloris trickle or an idle socket is closed, not kept forever;
- one client address may hold at most ``max_per_client`` connections; past that a new one is
  answered 429 and closed, so one client cannot take every socket the process can open.

A connection closed while its request body is still coming (a 413 or 408 answered early) closes
lingering: the write side is shut after the answer, and what the client still sends is read and
dropped for up to ``LINGER_SECONDS``. Closing at once with unread bytes makes the kernel reset the
connection, and a reset can destroy the answer before the client reads it.

Bodies are read by the gate (app.py) against their own deadline, before a request counts as in
flight.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)

LINGER_SECONDS = 10.0

_TOO_MANY_BODY = b'{"error":{"message":"too many connections from this address","type":"rate_limit_error"}}'
_TOO_MANY = (b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\nconnection: close\r\n"
             b"retry-after: 1\r\ncontent-length: %d\r\n\r\n%s" % (len(_TOO_MANY_BODY), _TOO_MANY_BODY))


class _LingeringTransport:
    """The connection's transport, whose ``close`` lingers while the request body is unfinished."""

    def __init__(self, transport, protocol) -> None:
        self._transport = transport
        self._protocol = protocol

    def __getattr__(self, name):
        return getattr(self._transport, name)

    def close(self) -> None:
        t, p = self._transport, self._protocol
        if p.lingering or t.is_closing():
            return
        if p.conn.their_state is not h11.SEND_BODY or not t.can_write_eof():
            return t.close()
        p.lingering = True
        t.write_eof()  # after the answer still buffered
        t.resume_reading()
        p.loop.call_later(LINGER_SECONDS, t.close)


class ConnectionGuard:
    """What the guarded connections share: the open connections per client address, and the limits."""

    def __init__(self, header_timeout: float, max_per_client: int | None) -> None:
        self.header_timeout = header_timeout
        self.max_per_client = max_per_client
        self.open = Counter()

    def admit(self, address: str) -> bool:
        if self.max_per_client and self.open[address] >= self.max_per_client:
            return False
        self.open[address] += 1
        return True

    def release(self, address: str) -> None:
        self.open[address] -= 1
        if not self.open[address]:
            del self.open[address]

    def protocol(self) -> type[H11Protocol]:
        """The protocol class uvicorn builds each connection with (``uvicorn.Config(http=...)``)."""
        guard = self

        class GuardedH11Protocol(H11Protocol):
            _address: str | None = None
            _timer: asyncio.TimerHandle | None = None
            lingering = False

            def connection_made(self, transport) -> None:
                super().connection_made(transport)
                self.transport = _LingeringTransport(transport, self)
                address = self.client[0] if self.client else ""
                if not guard.admit(address):
                    logger.warning("refused a connection from %s: %d open", address, guard.open[address])
                    transport.write(_TOO_MANY)
                    transport.close()
                    return
                self._address = address
                self._await_headers()

            def data_received(self, data: bytes) -> None:
                if not self.lingering:  # else the rest of a refused body: dropped
                    super().data_received(data)

            def connection_lost(self, exc) -> None:
                if self._address is not None:
                    guard.release(self._address)
                    self._address = None
                if self._timer is not None:
                    self._timer.cancel()
                super().connection_lost(exc)

            def on_response_complete(self) -> None:
                super().on_response_complete()
                self._await_headers()

            def _await_headers(self) -> None:
                """Close the connection unless a new request's headers are in by the deadline."""
                if self._timer is not None:
                    self._timer.cancel()
                self._timer = self.loop.call_later(guard.header_timeout, self._headers_overdue, self.cycle)

            def _headers_overdue(self, cycle_then) -> None:
                idle = cycle_then is None or cycle_then.response_complete
                if self.cycle is cycle_then and idle and not self.transport.is_closing():
                    self.transport.close()

        return GuardedH11Protocol
