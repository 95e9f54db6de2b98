"""The prefill engine: computes prompts and offers their KV to the decode engine of each request.

A request arrives with its room (the gateway sends the same request, with the same bootstrap
host, port and room, to a decode engine). Its room is offered at once, so a decode engine that
asks first waits; the request runs as one of at most one token (as SGLang's prefill does); the
step that computes the end of its prompt exports the prompt's pages (payload.py) and publishes
them, before the request ends and its pages go back. What was published stays staged in the
transport until the decode engine fetched it or ``timeout`` passed, then is dropped; an aborted
request withdraws its room. A room the transport still knows is refused (``InvalidRequest``): a
client must not take over another request's room.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from ..engine import EngineCore
from ..errors import InvalidRequest
from ..families.kv_transport import Offer
from ..request import Request
from ..sampling_params import SamplingParams
from ..sequence import Sequence
from .payload import carrier, export_payload
from .transport import create_transport

logger = logging.getLogger(__name__)


class PrefillEngine(EngineCore):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.transport = create_transport(self)
        self._offers: dict[str, Offer] = {}  # request id -> its room, until the prompt's pages are published
        self.carrier = carrier(self.speculator)  # whose features the pages carry (payload.py)

    def add_request(self, request_id: str, ids: list[int], params: SamplingParams) -> Request:
        peer = params.kv_transfer
        if peer is None:
            raise InvalidRequest("bootstrap_room", "is required: a prefill engine serves requests the gateway "
                                 "sends with a bootstrap host, port and room")
        try:
            offer = self.transport.offer(peer.room)
        except ValueError as exc:
            raise InvalidRequest("bootstrap_room", f"{peer.room} is refused: {exc}") from None
        try:
            req = super().add_request(request_id, ids, dataclasses.replace(params, max_tokens=1, min_tokens=0))
        except BaseException:
            offer.cancel()
            raise
        self._offers[request_id] = offer
        return req

    def abort_request(self, request_id: str):
        offer = self._offers.pop(request_id, None)
        if offer is not None:
            offer.cancel()
        return super().abort_request(request_id)

    def _sample(self, seqs: list[Sequence], rows: list[int], logits: torch.Tensor):
        """A sequence draws its first token in the step that computed the end of its prompt: its
        pages are whole now, before anything can free them."""
        for seq in seqs:
            offer = self._offers.pop(seq.request_id, None) if seq.index == 0 else None
            if offer is not None:
                offer.publish(export_payload(self.kv_manager, self.components.kv, seq, self.carrier))
        return super()._sample(seqs, rows, logits)
