"""KV-transport family: moves a request's prompt KV between engines (prefill/decode disaggregation).

Shaped by SGLang's bootstrap protocol: the gateway sends each request to a prefill and a decode
server with the same bootstrap host, port and room (a random id); the prefill server listens on
the bootstrap port. The prefill side *offers* a room when the request arrives and *publishes* its
pages once the prompt is computed (core/disagg/prefill.py); the decode side, holding pages for
them through the KV manager, *fetches* the room from the peer (core/disagg/decode.py). Either may
come first. Handles are polled once a step, so no step waits on the network.

Pages move as bytes, one blob per page with every KV component of it (``KVCache.read_pages``),
each with its digest (``disagg.payload.page_digest``). Transfers are prefix-aware: the fetcher says
how many leading pages it holds already (a hit in its own prefix cache) and only the rest move. It
states what it expects (token count, a digest of the token ids, the page layout, the pages it
holds, each other page's size) and anything else (a foreign
room, another prompt, a short or corrupt page) fails the transfer: the decode side never serves
KV it did not get whole. Nothing read from a socket is unpickled; peers authenticate with a
shared secret; listeners bind loopback unless configured otherwise.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any


class TransferStatus(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"  # the pages are not usable


@dataclass(frozen=True)
class KVPeer:
    """The prefill engine of a transfer, as SGLang's bootstrap protocol names it: host, bootstrap
    port and the room (one request's transfer slot there)."""

    host: str
    port: int
    room: int


@dataclass(frozen=True)
class KVPayload:
    """One request's prompt KV: the pages of its first ``num_tokens`` tokens from page
    ``first_page`` on, in order (the pages before it are the fetcher's already)."""

    num_tokens: int
    token_digest: bytes  # of the token ids those pages hold (payload.token_digest)
    layout: bytes  # digest of the page layout (layers, element types, page size, window reach)
    pages: list[bytes]  # one blob per page: every KV component of it
    checksums: list[bytes]  # one per page (disagg.payload.page_digest, 16 bytes)
    first_page: int = 0

    def from_page(self, first_page: int) -> KVPayload:
        """The same KV for a fetcher holding its first ``first_page`` pages (at least this one's)."""
        k = first_page - self.first_page
        if not 0 <= k <= len(self.pages):
            raise ValueError(f"pages from {first_page} asked of {len(self.pages)} from {self.first_page}")
        return dataclasses.replace(self, pages=self.pages[k:], checksums=self.checksums[k:], first_page=first_page)


@dataclass(frozen=True)
class KVExpectation:
    """What a fetcher accepts: anything else fails the transfer."""

    num_tokens: int
    token_digest: bytes
    layout: bytes
    page_sizes: list[int]  # bytes of each page's blob, from ``first_page`` on
    first_page: int = 0  # leading pages the fetcher holds (its prefix cache's): they do not move


class TransferHandle(ABC):
    """One transfer in flight."""

    @abstractmethod
    def status(self) -> TransferStatus:
        """Non-blocking; polled once a step."""

    @property
    def error(self) -> str | None:
        """Why a FAILED transfer failed."""
        return None

    def cancel(self) -> None:
        """The request was aborted: stop, and drop what was staged for it."""


class Offer(TransferHandle):
    """Prefill side: a room announced when its request arrives."""

    @abstractmethod
    def publish(self, payload: KVPayload) -> None:
        """The room's pages are computed: hand them to the decode engine that fetches the room."""


class Fetch(TransferHandle):
    """Decode side: a room being fetched."""

    @abstractmethod
    def payload(self) -> KVPayload:
        """The pages, checked against the expectation; only once DONE."""


class KVTransport(ABC):
    """One transport; ``create(ctx)`` of an ``engine_register_kv_transports`` descriptor builds it.
    ``ctx.engine_config.disaggregation`` (core/disagg/config.py) says where to listen and the secret."""

    name: str = "?"

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx

    @abstractmethod
    def offer(self, room: int) -> Offer:
        """Prefill side: a decode engine may fetch ``room`` from now on (it waits for the pages).
        ValueError for a room still known here (a forged or replayed room must not take another
        request's place)."""

    @abstractmethod
    def fetch(self, peer: KVPeer, expect: KVExpectation) -> Fetch:
        """Decode side: fetch ``peer.room``'s pages from the prefill engine at ``peer``."""

    @property
    def bootstrap_port(self) -> int | None:
        """The port a prefill engine listens on (None on the decode side)."""
        return None

    def wait(self, timeout: float) -> None:
        """Block until a transfer may have changed state, or for ``timeout`` seconds (an engine with
        nothing to compute waits here instead of spinning)."""
        time.sleep(timeout)

    def close(self) -> None:
        """Shut down listeners and connections."""
