"""The decode engine: takes each request's prompt KV from its prefill engine, then decodes it.

A request waits in arrival order until a running slot and pages for its prompt are free; its
pages are taken through the KV manager (``import_pages``) and the room is fetched from the prefill
engine the request names. When the pages arrived whole (sizes, digests and every checksum checked,
payload.py) they are written into the KV cache and the request joins the running batch with its
prompt computed but for the last token, which its first step computes, drawing the first token as
a colocated engine would. A transfer that fails (the prefill engine gone or refusing, a page cut
short or corrupt) fails the request with ``KVTransferError`` and gives its pages back; so does an
abort. Pages the decode engine already holds in its prefix cache are fetched again (not yet
prefix-aware).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ..engine import EngineCore
from ..errors import InvalidRequest, KVTransferError
from ..families.kv_transport import Fetch, TransferStatus
from ..request import Request
from ..sampling_params import SamplingParams
from .payload import expectation, import_payload, tokens_to_move
from .transport import create_transport

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.01  # with nothing to compute, how long a step waits for a transfer


@dataclass
class _Arriving:
    req: Request
    fetch: Fetch | None = None  # None: waiting for a slot and pages
    imported: bool = False  # its pages are written; it waits for a running slot


class DecodeEngine(EngineCore):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.transport = create_transport(self)
        self._arriving: dict[str, _Arriving] = {}

    def add_request(self, request_id: str, ids: list[int], params: SamplingParams) -> Request:
        if params.kv_transfer is None:
            raise InvalidRequest("bootstrap_room", "is required: a decode engine serves requests the gateway "
                                 "sends with a bootstrap host, port and room")
        return super().add_request(request_id, ids, params)

    def _queue(self, req: Request) -> None:
        if tokens_to_move(req.prompt_token_ids) == 0:
            super()._queue(req)  # a one-token prompt: nothing to fetch, its step computes it
        else:
            self._arriving[req.request_id] = _Arriving(req)

    def abort_request(self, request_id: str):
        arriving = self._arriving.pop(request_id, None)
        if arriving is not None:
            if arriving.fetch is not None:
                arriving.fetch.cancel()
            self.kv_manager.free(arriving.req.seqs[0], cache=False)
        return super().abort_request(request_id)

    def step_outputs(self):
        self._advance()
        if self._arriving and self._in_flight is None and not self.scheduler.has_work():
            self.transport.wait(IDLE_WAIT_S)
            self._advance()
        return super().step_outputs()

    def _advance(self) -> None:
        """Start fetches in arrival order while slots and pages allow; let in those that arrived."""
        kvm, kv = self.kv_manager, self.components.kv
        free_slots = self.config.max_num_seqs - self.scheduler.num_running
        for request_id, a in list(self._arriving.items()):
            seq, prompt = a.req.seqs[0], a.req.prompt_token_ids
            if a.fetch is None:
                if free_slots <= 0 or kvm.import_pages(seq, tokens_to_move(prompt)) is None:
                    break  # first come, first served: later requests wait behind it
                a.fetch = self.transport.fetch(a.req.params.kv_transfer, expectation(kvm, kv, prompt))
            status = a.fetch.status()
            if status is TransferStatus.PENDING:
                continue
            if status is TransferStatus.FAILED:
                del self._arriving[request_id]
                kvm.free(seq, cache=False)
                del self.requests[request_id]
                logger.warning("request %s failed: %s", request_id, a.fetch.error)
                self.failures.append((request_id, KVTransferError(a.fetch.error)))
                continue
            if not a.imported:
                import_payload(kvm, kv, seq, a.fetch.payload())
                a.imported = True
            if free_slots <= 0:
                continue
            del self._arriving[request_id]
            self.scheduler.add_computed(a.req.seqs, tokens_to_move(prompt))
            free_slots -= 1
