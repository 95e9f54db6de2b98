"""The tcp KV transport on its own, the nixl one (the same control plane, pages moved by a
NIXL READ over UCX) where nixl is installed, the mooncake one (a Mooncake Transfer Engine read over
its TCP protocol) where its engine loads, and the cuda_ipc one between two engines of one process
(the pages lent in memory, no IPC handle: CUDA opens none in the process that made it): pages move
whole (only those past the ones the fetcher holds), and what is forged, stale or withdrawn is
refused (a wrong secret, another prompt, an unknown or aborted room, pages nobody fetched in time).
The transports moving a staged buffer (nixl, mooncake) also refuse a descriptor or DONE tampered in
transit and withdraw the buffer, confirmed or not."""

from __future__ import annotations

import dataclasses
import importlib.util
import random
import time
from types import SimpleNamespace

import pytest

from engine.core.disagg.config import DisaggConfig
from engine.core.disagg.payload import page_digest
from engine.core.families.kv_transport import KVExpectation, KVPayload, KVPeer, TransferStatus
from engine.backends.cuda.kv_ipc import CudaIpcTransport
from engine.core.native.kv_staged import DESC, DONE, StagedTransport
from engine.core.native.kv_tcp import FETCH, PAGE, REPLY, TAG_BYTES, TcpTransport
from engine.plugins.mooncake_kv import MooncakeTransport, mooncake_kv_reasons
from engine.plugins.nixl_kv import NixlTransport
from tampering_proxy import TamperingProxy

HAVE_NIXL = importlib.util.find_spec("nixl") is not None
NO_MOONCAKE = mooncake_kv_reasons(None)

TIMEOUT = 1.5


def _transport(mode: str, secret: str = "s3cret", kind: type[TcpTransport] = TcpTransport,
               plugin_options: dict | None = None) -> TcpTransport:
    cfg = DisaggConfig(mode=mode, bootstrap_port=0, secret=secret, timeout=TIMEOUT, transfer_backend=kind.name)
    return kind(SimpleNamespace(engine_config=SimpleNamespace(disaggregation=cfg, device=None,
                                                              plugin_options=plugin_options),
                                platform=SimpleNamespace(torch_device="cpu")))


def _payload() -> KVPayload:
    pages = [random.randbytes(random.randint(1, 5000)) for _ in range(random.randint(1, 6))]
    checksums = [page_digest(p) for p in pages]
    return KVPayload(random.randint(1, 500), random.randbytes(16), random.randbytes(16), pages, checksums)


def _expect(p: KVPayload, **change) -> KVExpectation:
    fields = dict(num_tokens=p.num_tokens, token_digest=p.token_digest, layout=p.layout,
                  page_sizes=[len(x) for x in p.pages])
    return KVExpectation(**{**fields, **change})


def _wait(handle, timeout: float = 10.0) -> TransferStatus:
    deadline = time.monotonic() + timeout
    while (status := handle.status()) is TransferStatus.PENDING:
        assert time.monotonic() < deadline, "the transfer never ended"
        time.sleep(0.01)
    return status


@pytest.fixture(scope="module", params=[TcpTransport, pytest.param(NixlTransport, marks=pytest.mark.skipif(
    not HAVE_NIXL, reason="nixl is not installed (pip install 'engine[nixl]')")),
    pytest.param(MooncakeTransport, marks=pytest.mark.skipif(bool(NO_MOONCAKE), reason="; ".join(NO_MOONCAKE))),
    CudaIpcTransport], ids=["tcp", "nixl", "mooncake", "cuda_ipc-one-process"])
def ends(request):
    prefill, decode = _transport("prefill", kind=request.param), _transport("decode", kind=request.param)
    yield prefill, decode
    prefill.close()


def _peer(prefill: TcpTransport, room: int) -> KVPeer:
    return KVPeer("127.0.0.1", prefill.bootstrap_port, room)


def test_pages_fetched_before_they_are_published_arrive_whole(ends, seed):
    prefill, decode = ends
    room, payload = random.randrange(2**63), _payload()
    fetch = decode.fetch(_peer(prefill, room), _expect(payload))  # the decode engine asks first
    offer = prefill.offer(room)
    time.sleep(0.1)
    assert fetch.status() is TransferStatus.PENDING
    offer.publish(payload)
    assert _wait(fetch) is TransferStatus.DONE
    assert fetch.payload() == payload
    assert _wait(offer) is TransferStatus.DONE


def test_a_fetcher_holding_leading_pages_gets_only_the_rest(ends, seed):
    prefill, decode = ends
    room, payload = random.randrange(2**63), _payload()
    held = random.randint(1, len(payload.pages))  # all of them too: then nothing but the reply moves
    offer = prefill.offer(room)
    offer.publish(payload)
    fetch = decode.fetch(_peer(prefill, room), _expect(payload, first_page=held,
                                                       page_sizes=[len(x) for x in payload.pages[held:]]))
    assert _wait(fetch) is TransferStatus.DONE
    got = fetch.payload()
    assert got.first_page == held and got.pages == payload.pages[held:] and got.checksums == payload.checksums[held:]
    assert _wait(offer) is TransferStatus.DONE


@pytest.mark.parametrize("forgery", ["secret", "prompt", "layout", "page count", "page size", "first page", "room"])
def test_forged_or_foreign_fetches_are_refused(ends, forgery, seed):
    prefill, decode = ends
    room, payload = random.randrange(2**63), _payload()
    offer = prefill.offer(room)
    offer.publish(payload)
    sizes = [len(x) for x in payload.pages]
    change = {"prompt": {"token_digest": bytes(16)}, "layout": {"layout": bytes(16)},
              "page count": {"page_sizes": sizes + [10]},
              "page size": {"page_sizes": [s + 1 for s in sizes]},
              "first page": {"first_page": 1}}.get(forgery, {})
    asker = _transport("decode", "guess", type(decode)) if forgery == "secret" else decode
    peer = _peer(prefill, room + 1 if forgery == "room" else room)
    fetch = asker.fetch(peer, _expect(payload, **change))
    assert _wait(fetch) is TransferStatus.FAILED
    want = {"secret": "not authenticated", "room": "no request in room", "page size": "this engine's pages are"}
    assert want.get(forgery, "another prompt or page layout") in fetch.error
    if forgery == "room":  # another room's wait (the whole timeout) says nothing of this one
        return
    honest = decode.fetch(_peer(prefill, room), _expect(payload))
    if forgery == "page size":  # refused by the reader mid-transfer: the room is spent
        assert _wait(honest) is TransferStatus.FAILED
    else:  # refused before a byte of it was sent: the room still serves its own decode engine
        assert _wait(honest) is TransferStatus.DONE and honest.payload() == payload


def test_a_corrupt_page_fails_the_transfer(ends, seed):
    prefill, decode = ends
    room, payload = random.randrange(2**63), _payload()
    i = random.randrange(len(payload.pages))
    page = bytearray(payload.pages[i])
    page[random.randrange(len(page))] ^= 1 << random.randrange(8)
    offer = prefill.offer(room)
    offer.publish(dataclasses.replace(payload, pages=payload.pages[:i] + [bytes(page)] + payload.pages[i + 1:]))
    fetch = decode.fetch(_peer(prefill, room), _expect(payload))
    assert _wait(fetch) is TransferStatus.FAILED and f"page {i} failed its checksum" in fetch.error


def test_an_aborted_room_is_refused_at_once(ends):
    prefill, decode = ends
    room, payload = random.randrange(2**63), _payload()
    prefill.offer(room).cancel()
    started = time.monotonic()
    fetch = decode.fetch(_peer(prefill, room), _expect(payload))
    assert _wait(fetch) is TransferStatus.FAILED and "aborted" in fetch.error
    assert time.monotonic() - started < TIMEOUT


def test_pages_nobody_fetches_are_dropped_after_the_timeout(ends):
    prefill, decode = ends
    room, payload = random.randrange(2**63), _payload()
    offer = prefill.offer(room)
    offer.publish(payload)
    assert _wait(offer, timeout=TIMEOUT + 3) is TransferStatus.FAILED
    assert "in time" in offer.error and offer.payload is None
    late = decode.fetch(_peer(prefill, room), _expect(payload))
    assert _wait(late) is TransferStatus.FAILED


# -- the transports moving a staged buffer with a transfer library (core/native/kv_staged.py) -------

class InProcessStaged(StagedTransport):
    """The staged exchange with no library, for where none is installed: the decode engine copies
    from the prefill's buffer in this process, while it is exposed."""
    library = "in-process"
    exposed: dict = {}  # address -> staged buffer, shared by both ends

    def _expose(self, staged):
        self.exposed[staged.data_ptr()] = staged
        return b"this process", staged.data_ptr()

    def _withdraw(self, address: int) -> None:
        del self.exposed[address]

    def _read(self, metadata: bytes, address: int, buffer, total: int) -> None:
        if address not in self.exposed or len(self.exposed[address]) < total:
            raise ConnectionError(f"the in-process read of {total} bytes at {address:#x} found no exposed buffer")
        buffer[:total] = self.exposed[address][:total]


@pytest.fixture(scope="module", params=[InProcessStaged, pytest.param(NixlTransport, marks=pytest.mark.skipif(
    not HAVE_NIXL, reason="nixl is not installed (pip install 'engine[nixl]')")),
    pytest.param(MooncakeTransport, marks=pytest.mark.skipif(bool(NO_MOONCAKE), reason="; ".join(NO_MOONCAKE)))],
    ids=["in-process", "nixl", "mooncake"])
def staged(request):
    prefill, decode = _transport("prefill", kind=request.param), _transport("decode", kind=request.param)
    yield prefill, decode
    prefill.close()


def _exposures(monkeypatch, prefill: StagedTransport) -> list:
    """The prefill's staged buffers still exposed, as they come and go."""
    held, expose, withdraw = [], prefill._expose, prefill._withdraw

    def exposing(staged):
        metadata, exposed = expose(staged)
        held.append(exposed)
        return metadata, exposed

    def withdrawing(exposed):
        held.remove(exposed)
        withdraw(exposed)

    monkeypatch.setattr(prefill, "_expose", exposing)
    monkeypatch.setattr(prefill, "_withdraw", withdrawing)
    return held


def _descriptor(part: str, num_pages: int):
    """Where in the prefill's answer ``part`` of its descriptor lies (a random byte of it)."""
    start, pick = REPLY.size + TAG_BYTES, random.random()

    def where(seen: bytes) -> int | None:
        if len(seen) < start + DESC.size:
            return None
        length = DESC.unpack_from(seen, start)[0]
        at, size = {"address": (start + 4, 8), "metadata": (start + DESC.size, length),
                    "page header": (start + DESC.size + length, PAGE.size * num_pages)}[part]
        return at + int(pick * size)
    return where


@pytest.mark.parametrize("part", ["address", "metadata", "page header"])
def test_a_tampered_descriptor_is_refused_and_the_buffer_withdrawn(staged, part, monkeypatch, seed):
    prefill, decode = staged
    held = _exposures(monkeypatch, prefill)
    room, payload = random.randrange(2**63), _payload()
    offer = prefill.offer(room)
    offer.publish(payload)
    proxy = TamperingProxy(prefill.bootstrap_port, to_decode=_descriptor(part, len(payload.pages)))
    fetch = decode.fetch(KVPeer("127.0.0.1", proxy.port, room), _expect(payload))
    assert _wait(fetch) is TransferStatus.FAILED and "descriptors are not authenticated" in fetch.error
    assert proxy.flipped.is_set()
    assert _wait(offer) is TransferStatus.FAILED and held == []


def test_a_tampered_done_fails_the_room_and_the_buffer_is_withdrawn(staged, monkeypatch, seed):
    prefill, decode = staged
    held = _exposures(monkeypatch, prefill)
    room, payload = random.randrange(2**63), _payload()
    offer = prefill.offer(room)
    offer.publish(payload)
    at = FETCH.size + TAG_BYTES + random.randrange(len(DONE) + TAG_BYTES)
    proxy = TamperingProxy(prefill.bootstrap_port, to_prefill=lambda seen: at)
    fetch = decode.fetch(KVPeer("127.0.0.1", proxy.port, room), _expect(payload))
    assert _wait(fetch) is TransferStatus.DONE and fetch.payload() == payload  # it read them, then said so
    assert _wait(offer) is TransferStatus.FAILED and "did not confirm reading the pages" in offer.error
    assert proxy.flipped.is_set() and held == []


def test_pages_not_read_in_time_are_withdrawn(staged, monkeypatch, seed):
    prefill, decode = staged
    held = _exposures(monkeypatch, prefill)
    monkeypatch.setattr(prefill, "read_timeout", 0.3)
    room, payload = random.randrange(2**63), _payload()
    offer = prefill.offer(room)
    offer.publish(payload)
    read = decode._read

    def late(*args):
        _wait(offer)  # the prefill gave up on this reader
        read(*args)

    monkeypatch.setattr(decode, "_read", late)
    fetch = decode.fetch(_peer(prefill, room), _expect(payload))
    assert _wait(offer) is TransferStatus.FAILED and held == []
    if decode.library != "NIXL":  # Mooncake serves registered buffers only (UCX, NIXL's, read a withdrawn
        # buffer still here: a NIXL peer is trusted with more than its pages)
        assert _wait(fetch) is TransferStatus.FAILED and f"{decode.library} read" in fetch.error


@pytest.mark.skipif(bool(NO_MOONCAKE), reason="; ".join(NO_MOONCAKE))
def test_mooncake_takes_the_settings_the_storage_tier_takes(monkeypatch, seed):
    monkeypatch.setenv("MOONCAKE_LOCAL_HOSTNAME", "127.0.0.1")
    prefill = _transport("prefill", kind=MooncakeTransport)  # the environment's name
    decode = _transport("decode", kind=MooncakeTransport, plugin_options={"mooncake": {"local_hostname": "localhost"}})
    astray = _transport("prefill", kind=MooncakeTransport,
                        plugin_options={"mooncake": {"local_hostname": "nowhere.invalid"}})
    try:
        assert prefill.session.startswith(b"127.0.0.1:") and decode.session.startswith(b"localhost:")
        for source, fails in ((prefill, False), (astray, True)):  # the reader goes where the prefill's name says
            room, payload = random.randrange(2**63), _payload()
            source.offer(room).publish(payload)
            fetch = decode.fetch(_peer(source, room), _expect(payload))
            if fails:
                assert _wait(fetch) is TransferStatus.FAILED and "nowhere.invalid" in fetch.error
            else:
                assert _wait(fetch) is TransferStatus.DONE and fetch.payload() == payload
    finally:
        prefill.close()
        astray.close()
