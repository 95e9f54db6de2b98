"""The engine process's loop over real sockets: malformed messages are refused and logged, and the
engine keeps serving; what it streams adds up to what the engine generates."""

from __future__ import annotations

import logging
import os
import random
import threading

import msgspec
import pytest
import zmq

from engine import LLM, SamplingParams
from engine.core.config import EngineConfig
from engine.core.engine import EngineCore
from engine.server import wire
from engine.server.engine_process import EngineLoop
from engine.server.liveness import Liveness

ENGINE_OPTS = dict(dtype="float32", page_size=4, enable_prefix_caching=False)


class LoopPeer:
    """The API process's side of an ``EngineLoop`` running in a thread on inproc sockets."""

    def __init__(self, engine) -> None:
        self.ctx = zmq.Context()
        self.push, self.pull = self.ctx.socket(zmq.PUSH), self.ctx.socket(zmq.PULL)
        self.push.bind("inproc://requests")
        self.pull.bind("inproc://outputs")
        self.thread = threading.Thread(target=self._serve, args=(engine,), daemon=True)
        self.thread.start()

    def _serve(self, engine) -> None:
        pull, push = self.ctx.socket(zmq.PULL), self.ctx.socket(zmq.PUSH)
        pull.connect("inproc://requests")
        push.connect("inproc://outputs")
        with Liveness(self.ctx, "inproc://outputs") as live:
            EngineLoop(engine, pull, push, os.getppid(), live).run()
        pull.close(linger=0)
        push.close(linger=0)

    def send_raw(self, raw: bytes) -> None:
        self.push.send(raw)

    def replies(self, request_id: str) -> list:
        """Every message about ``request_id`` until it is refused or finished."""
        got = []
        while self.pull.poll(60_000):
            msg = wire.from_engine_decoder.decode(self.pull.recv())
            if isinstance(msg, wire.Rejected) and msg.request_id == request_id:
                return got + [msg]
            if isinstance(msg, wire.Outputs):
                got += [d for d in msg.deltas if d.request_id == request_id]
                if got and got[-1].finished:
                    return got
        raise AssertionError(f"no end for {request_id}")

    def close(self) -> None:
        self.push.send(wire.encoder.encode(wire.Shutdown()))
        self.thread.join(timeout=30)
        self.ctx.destroy(linger=0)


@pytest.fixture(scope="module")
def llm(tiny_qwen3):
    return LLM(str(tiny_qwen3), progress=False, **ENGINE_OPTS)


@pytest.fixture(scope="module")
def peer(tiny_qwen3):
    p = LoopPeer(EngineCore(EngineConfig(model=str(tiny_qwen3), **ENGINE_OPTS), progress=False))
    yield p
    p.close()


def add(request_id: str, ids, params: dict) -> bytes:
    """An add message as any peer could send it, its parts untyped."""
    return msgspec.msgpack.encode({"type": "add", "request_id": request_id, "prompt_token_ids": ids,
                                   "params": params})


MALFORMED = [
    ("temperature", "hot"),  # wrong type
    ("bogus", 1),  # a field SamplingParams does not have
    ("stop", ["x"]),  # stop strings are the API process's
    ("max_tokens", 2.5),  # a float where an int goes
    ("logit_bias", {"1": 2.0}),  # keys are ints on the wire
]


def test_malformed_messages_are_refused_and_logged_and_the_engine_serves(peer, llm, caplog, seed):
    caplog.set_level(logging.ERROR, logger="engine.server.engine_process")
    for i, (field, value) in enumerate(MALFORMED):
        peer.send_raw(add(f"bad-params-{i}", [1, 2, 3], {field: value}))
        (rejected,) = peer.replies(f"bad-params-{i}")
        assert rejected.code == "invalid_request" and field in rejected.detail
    peer.send_raw(add("bad-prompt", ["a"], {}))
    assert isinstance(peer.replies("bad-prompt")[0], wire.Rejected)
    peer.send_raw(os.urandom(random.randint(1, 64)))  # not even a message: dropped
    peer.send_raw(msgspec.msgpack.encode({"type": "no_such_message"}))
    peer.send_raw(add("bad-value", [1, 2, 3], {"top_p": 0.0}))  # well-formed, but not servable
    (rejected,) = peer.replies("bad-value")
    assert (rejected.code, rejected.field) == ("invalid_request", "top_p")
    logged = [r.getMessage() for r in caplog.records if r.name == "engine.server.engine_process"]
    assert all(any(f"bad-params-{i}" in m for m in logged) for i in range(len(MALFORMED)))
    assert any("bad-prompt" in m for m in logged)
    assert sum("dropped a malformed message" in m for m in logged) >= 2

    params = SamplingParams(temperature=0, max_tokens=random.randint(2, 8), ignore_eos=True)
    prompt = [random.randrange(1000) for _ in range(random.randint(3, 9))]
    peer.send_raw(wire.encoder.encode(wire.AddRequest("good", prompt, wire.engine_params(params))))
    deltas = peer.replies("good")
    tokens = [t for d in deltas for c in d.completions for t in c.token_ids]
    assert deltas[-1].finished and deltas[-1].completions[-1].finish_reason == "length"
    assert tokens == llm.generate([prompt], params)[0].outputs[0].token_ids


def test_sampling_params_cross_the_wire_unchanged_but_for_stop_strings(seed):
    params = SamplingParams(n=random.randint(1, 4), temperature=random.random(), top_k=random.randint(0, 50),
                            seed=random.randrange(2**31), stop=["\n"], stop_token_ids=[random.randrange(100)],
                            logprobs=random.choice([None, 0, 3]), logit_bias={random.randrange(100): -1.5},
                            max_tokens=random.randint(1, 99), ignore_eos=random.random() < 0.5)
    raw = wire.encoder.encode(wire.AddRequest("r", [1], wire.engine_params(params)))
    got = wire.sampling_params(wire.to_engine_decoder.decode(raw).params)
    assert got == SamplingParams(**{**params.__dict__, "stop": []})
