"""The decode engine: takes each request's prompt KV from its prefill engine, then decodes it.

A request waits in arrival order until a running slot and pages for its prompt are free; its
pages are taken through the KV manager (``import_pages``: the longest prefix its prefix cache
holds is shared from there, as in a colocated engine) and the rest of the room is fetched from the
prefill engine the request names: only the pages past the cache hit move. When the pages arrived whole (sizes, digests and every checksum checked,
payload.py) they are written into the KV cache and the request joins the running batch with its
prompt computed but for the last token, which its first step computes, drawing the first token as
a colocated engine would. A transfer that fails (the prefill engine gone, refusing or out of time,
a page cut short or corrupt) gives the pages back and queues the request as a colocated engine
would: this engine computes its prompt (its prefix cache still serving what it holds), so the
answer is the one a colocated engine gives, later. An abort gives the pages back too.
``transfers`` counts what moved and what failed (engine:kv_transfer_* on /metrics).
"""

from __future__ import annotations

import logging
import dataclasses
from dataclasses import dataclass

from ..engine import EngineCore
from ..engine_stats import EngineStats
from ..errors import InvalidRequest
from ..families.kv_transport import Fetch, TransferStatus
from ..request import Request
from ..sampling_params import SamplingParams
from .counters import TransferCounters
from .payload import carrier, expectation, import_payload, tokens_to_move
from .transport import create_transport

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.01  # with nothing to compute, how long a step waits for a transfer


@dataclass
class _Arriving:
    req: Request
    fetch: Fetch | None = None  # None: waiting for a slot and pages
    imported: bool = False  # its pages are written; it waits for a running slot
    carried: tuple | None = None  # the proposer's features that came with them (payload.import_carried)


class DecodeEngine(EngineCore):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.transport = create_transport(self)
        self._arriving: dict[str, _Arriving] = {}
        self.transfers = TransferCounters()
        self.carrier = carrier(self.speculator)  # whose features the pages carry (payload.py)

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

    def stats(self) -> EngineStats:
        return dataclasses.replace(super().stats(), kv_transfer=self.transfers.snapshot())

    def reset_counters(self) -> None:
        super().reset_counters()
        self.transfers = TransferCounters()

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
            n = tokens_to_move(prompt)
            if a.fetch is None:
                hit = kvm.import_pages(seq, prompt[:n]) if free_slots > 0 else None
                if hit is None:
                    break  # first come, first served: later requests wait behind it
                kvm.record_lookup(n, hit)
                a.fetch = self.transport.fetch(a.req.params.kv_transfer,
                                               expectation(kvm, kv, prompt, hit // kvm.page_size, self.carrier))
            status = a.fetch.status()
            if status is TransferStatus.PENDING:
                continue
            if status is TransferStatus.FAILED:
                del self._arriving[request_id]
                kvm.free(seq, cache=False)
                logger.warning("request %s: computing its prompt here: %s", request_id, a.fetch.error)
                self.transfers.num_failed += 1
                super()._queue(a.req)
                continue
            if not a.imported:
                payload = a.fetch.payload()
                a.carried = import_payload(kvm, kv, seq, payload, self.carrier)
                a.imported = True
                t = self.transfers
                t.num_transfers += 1
                t.pages_received += len(payload.pages) - (self.carrier is not None)
                t.bytes_received += sum(len(p) for p in payload.pages)
                t.pages_reused += payload.first_page
            if free_slots <= 0:
                continue
            del self._arriving[request_id]
            if a.carried is not None:
                self.carrier.carry_in(seq.seq_id, prompt, *a.carried)
            self.scheduler.add_computed(a.req.seqs, n)
            free_slots -= 1
