"""KV-transport family: moves KV pages between engines (prefill/decode disaggregation).

The interface issue 19 implements (tcp, cuda_ipc, nixl, mooncake, mori). Pages are named by id
lists on both sides: the decode side allocates destination pages through the KV manager and
sends their ids; the prefill side exports its pages and sends them. A transfer is asynchronous:
it returns a handle whose status the scheduler polls each step, so no step waits on the network.
Payloads carry checksums (``cache_tier.page_checksum``); a failed or corrupt transfer makes the
decode side recompute, never serve wrong KV.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any


class TransferStatus(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"  # the pages are not usable: recompute


@dataclass(frozen=True)
class KVPeer:
    """The other engine of a transfer, as SGLang's bootstrap protocol names it: host, port and the
    room (one request's transfer slot on that peer)."""

    host: str
    port: int
    room: int


class TransferHandle(ABC):
    """One transfer in flight."""

    @abstractmethod
    def status(self) -> TransferStatus:
        """Non-blocking; the scheduler polls it once a step."""

    @property
    def error(self) -> str | None:
        """Why a FAILED transfer failed (logged and counted by the caller)."""
        return None

    def cancel(self) -> None:
        """The request was aborted: stop, and let go of the pages on both sides."""


class KVTransport(ABC):
    """One transport; ``create(ctx)`` of an ``engine_register_kv_transports`` descriptor builds it."""

    name: str = "?"

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx

    @abstractmethod
    def send(self, peer: KVPeer, page_ids: list[int], dst_page_ids: list[int]) -> TransferHandle:
        """Prefill side: copy these local pages (every KV component of each) into the peer's ``dst_page_ids``."""

    @abstractmethod
    def receive(self, peer: KVPeer, page_ids: list[int]) -> TransferHandle:
        """Decode side: these local pages, allocated for the request, await the peer's KV; DONE when
        all arrived and their checksums matched."""

    def close(self) -> None:
        """Shut down listeners and connections."""
