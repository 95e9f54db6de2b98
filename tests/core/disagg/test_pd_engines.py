"""Prefill/decode disaggregation between two engines in this process over the tcp transport
(loopback), over nixl where it is installed, over mooncake where its Transfer Engine loads and over
cuda_ipc on a GPU: greedy output equal to a colocated engine on tiny-qwen3-py and tiny-dsv4-py, every
page back afterwards; an aborted request gives its pages back on both sides; a room in use is
refused on the prefill engine; a transfer that fails (a prefill engine that dies mid-page, sends a
corrupt page, refuses, is not one, or is gone) is counted and the decode engine computes the prompt
itself, answering as a colocated engine does and holding no page afterwards."""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import random
import re
import socket
import sys
import time

import pytest
import torch

from engine.core.config import EngineConfig
from engine.core.disagg import engine_class
from engine.core.disagg.payload import expectation, page_digest
from engine.core.engine import EngineCore
from engine.core.errors import InvalidRequest
from engine.core.registry import SelectionError
from engine.core.families.kv_transport import KVPeer
from engine.core.sampling_params import SamplingParams
from engine.plugins.mooncake_kv import mooncake_kv_reasons
from fake_prefill import FakePrefill

MAX_TOKENS = 8


def _engine(model, **disagg) -> EngineCore:
    config = EngineConfig(model=str(model), max_model_len=512, num_pages=160, page_size=16, warmup=False,
                          disaggregation=disagg or None)
    return engine_class(config)(config, progress=False)


class Pair:
    """A prefill and a decode engine, stepped in turn as their two processes would run."""

    def __init__(self, model, transport: str = "tcp") -> None:
        self.prefill = _engine(model, mode="prefill", bootstrap_port=0, timeout=5.0, transfer_backend=transport)
        self.decode = _engine(model, mode="decode", timeout=5.0, transfer_backend=transport)
        self.rooms = iter(range(random.randrange(2**40), 2**62))

    def peer(self) -> KVPeer:
        return KVPeer("127.0.0.1", self.prefill.transport.bootstrap_port, next(self.rooms))

    def run(self, requests: dict[str, tuple[list[int], SamplingParams]], timeout: float = 120.0):
        """Every request to both engines; the decode side's token ids per (request, index), and failures."""
        for rid, (ids, params) in requests.items():
            params = dataclasses.replace(params, kv_transfer=self.peer())
            self.prefill.add_request(rid, ids, params)
            self.decode.add_request(rid, ids, params)
        return drive(self.prefill, self.decode, timeout)


def drive(prefill: EngineCore | None, decode: EngineCore, timeout: float):
    out, failures, deadline = {}, {}, time.monotonic() + timeout
    engines = [e for e in (prefill, decode) if e is not None]
    while any(e.has_unfinished_requests() for e in engines):
        assert time.monotonic() < deadline, "the engines did not finish"
        for e in engines:
            if e.has_unfinished_requests():
                outputs = e.step_outputs()
                if e is decode:
                    for o in outputs:
                        for c in o.completions:
                            out.setdefault((o.request_id, c.index), []).extend(c.token_ids)
        failures.update((rid, exc) for rid, exc in decode.take_failures())
    return out, failures


def colocated(engine: EngineCore, requests) -> dict:
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, ids, params)
    return drive(None, engine, 120)[0]


def assert_idle(engine: EngineCore) -> None:
    """No page held by a request (cached prefixes may stay), and every reference accounted for."""
    engine.kv_manager.check_consistency()
    assert engine.kv_manager.stats().usage == 0.0


NIXL = pytest.mark.skipif(importlib.util.find_spec("nixl") is None,
                          reason="nixl is not installed (pip install 'engine[nixl]')")
NO_MOONCAKE = mooncake_kv_reasons(None)
MOONCAKE = pytest.mark.skipif(bool(NO_MOONCAKE), reason="; ".join(NO_MOONCAKE))
OVER_TCP = [("tiny-qwen3-py", "tcp"), ("tiny-dsv4-py", "tcp")]


@pytest.fixture(scope="module", params=OVER_TCP + [pytest.param(("tiny-qwen3-py", "nixl"), marks=NIXL),
                                                   pytest.param(("tiny-dsv4-py", "nixl"), marks=NIXL),
                                                   pytest.param(("tiny-qwen3-py", "mooncake"), marks=MOONCAKE),
                                                   pytest.param(("tiny-dsv4-py", "mooncake"), marks=MOONCAKE),
                                                   pytest.param(("tiny-qwen3-py", "cuda_ipc"), marks=pytest.mark.gpu)],
                ids=lambda p: "-".join(p))
def engines(request, shared_dir):
    model, transport = request.param
    model = shared_dir / "models" / model
    return Pair(model, transport), _engine(model)


def test_greedy_through_prefill_and_decode_equals_colocated(engines, seed):
    pair, reference = engines
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    lengths = [1, 2, 16, 17, random.randint(3, 200), random.randint(3, 200)]  # page-aligned ends too
    requests = {f"r{i}": ([random.randrange(5, 4000) for _ in range(n)], greedy) for i, n in enumerate(lengths)}
    requests["n2"] = ([random.randrange(5, 4000) for _ in range(40)], dataclasses.replace(greedy, n=2))
    want = colocated(reference, requests)
    got, failures = pair.run(requests)
    assert not failures
    assert got == want
    assert len(got) == len(lengths) + 2
    first = pair.decode.stats().kv_transfer
    hits = pair.prefill.kv_manager.stats().prefix_hits
    # the same prompts again: prefix hits on both engines, and the decode engine's pages are not sent
    again, failures = pair.run({f"{rid}'": r for rid, r in requests.items()})
    assert not failures and pair.prefill.kv_manager.stats().prefix_hits > hits
    assert again == {(f"{rid}'", i): tokens for (rid, i), tokens in want.items()}
    second = pair.decode.stats().kv_transfer
    pages = sum(-(-(len(ids) - 1) // 16) for ids, _ in requests.values())
    moved, reused = second.pages_received - first.pages_received, second.pages_reused - first.pages_reused
    assert moved + reused == pages and reused > 0
    assert second.bytes_received - first.bytes_received < first.bytes_received
    if pair.decode.kv_manager.window is None:  # every whole page of each prompt is cached
        assert reused == sum((len(ids) - 1) // 16 for ids, _ in requests.values())
    for e in (pair.prefill, pair.decode):
        assert_idle(e)


def test_an_aborted_request_gives_its_pages_back_on_both_sides(engines):
    pair, _ = engines
    ids = [random.randrange(5, 4000) for _ in range(90)]
    params = dataclasses.replace(SamplingParams(temperature=0, max_tokens=4), kv_transfer=pair.peer())
    pair.decode.add_request("gone", ids, params)  # its prefill engine never hears of it: the fetch waits
    pair.decode.step_outputs()
    assert pair.decode.kv_manager.stats().usage > 0  # pages taken for the prompt
    assert pair.decode.abort_request("gone").finished
    pair.prefill.add_request("gone-too", ids, params)
    pair.prefill.abort_request("gone-too")
    for e in (pair.prefill, pair.decode):
        assert_idle(e)


def test_a_room_in_use_is_refused_and_its_request_served(engines, seed):
    """A client naming another request's room on the prefill engine must not take its place."""
    pair, reference = engines
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    ids = [random.randrange(5, 4000) for _ in range(40)]
    params = dataclasses.replace(greedy, kv_transfer=pair.peer())
    pair.prefill.add_request("owner", ids, params)
    pair.decode.add_request("owner", ids, params)
    with pytest.raises(InvalidRequest, match="bootstrap_room .* is in use"):
        pair.prefill.add_request("thief", [random.randrange(5, 4000) for _ in range(40)], params)
    failed = pair.decode.stats().kv_transfer.num_failed
    got, failures = drive(pair.prefill, pair.decode, 60)
    assert not failures and got == colocated(reference, {"owner": (ids, greedy)})
    assert pair.decode.stats().kv_transfer.num_failed == failed
    for e in (pair.prefill, pair.decode):
        assert_idle(e)


def _closed_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as s:
        return s.getsockname()[1]


FAULTS = {"dies mid-page": "closed the connection", "corrupt page": "failed its checksum",
          "refuses": "refused .*no request in room", "answers junk": "not authenticated",
          "peer gone": "Connection refused"}


@pytest.mark.parametrize("engines", OVER_TCP, indirect=True, ids=lambda p: "-".join(p))  # a fake tcp prefill
@pytest.mark.parametrize("fault", FAULTS)
def test_a_failed_transfer_is_computed_here_with_the_colocated_answer(engines, fault, caplog, seed):
    pair, reference = engines
    dec = pair.decode
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    ids = [random.randrange(5, 4000) for _ in range(70)]
    want = colocated(reference, {"doomed": (ids, greedy)})
    port = _closed_port()
    if fault != "peer gone":
        expect = expectation(dec.kv_manager, dec.components.kv, ids)
        pages = [random.randbytes(size) for size in expect.page_sizes]
        checksums = [page_digest(p) for p in pages]
        if fault == "corrupt page":
            pages[-1] = bytes([pages[-1][0] ^ 1]) + pages[-1][1:]
        port = FakePrefill(dec.config.disaggregation.secret.encode(), pages, checksums, fault).port
    failed = dec.stats().kv_transfer.num_failed
    dec.add_request("doomed", ids, dataclasses.replace(greedy, kv_transfer=KVPeer("127.0.0.1", port, 7)))
    with caplog.at_level(logging.WARNING, logger="engine.core.disagg.decode"):
        got, failures = drive(None, dec, 60)
    assert not failures and got == want
    assert re.search(f"request doomed: computing its prompt here: .*{FAULTS[fault]}", caplog.text)
    assert dec.stats().kv_transfer.num_failed == failed + 1
    assert_idle(dec)


@pytest.mark.parametrize("backend,why", [("cuda_ipc", "needs NVIDIA GPUs of one node"),
                                         ("nixl", r"nixl package is not installed \(pip install 'engine\[nixl\]'\)"),
                                         ("mooncake", r"mooncake package is not installed \(pip install "
                                                      r"'engine\[mooncake\]'\)|Transfer Engine does not load"),
                                         ("mori", "'mori' is not registered")])
def test_a_transport_that_cannot_serve_here_is_refused_with_the_reason(shared_dir, backend, why, monkeypatch):
    if {"cuda_ipc": torch.cuda.is_available(), "nixl": importlib.util.find_spec("nixl") is not None}.get(backend):
        pytest.skip(f"{backend} can serve here")
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)  # an engine that does not load (no libibverbs)
    with pytest.raises(SelectionError, match=why):
        _engine(shared_dir / "models" / "tiny-qwen3-py", mode="decode", transfer_backend=backend)
