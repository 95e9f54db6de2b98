"""Typed engine errors: their codes map to HTTP answers, fields are renamed as the client spelled
them, and an error crosses the wire as its parts and comes back the same."""

from __future__ import annotations

import random

import pytest

from engine.core.context import check_context
from engine.core.errors import EngineDeadError, EngineError, ErrorCode, InvalidRequest, rebuild
from engine.core.sampling_params import SamplingParams
from engine.server import wire
from engine.server.errors import engine_error

BAD_PARAMS = [("n", 0), ("temperature", -1.0), ("top_p", 0.0), ("top_k", -2), ("min_p", 2.0),
              ("presence_penalty", 3.0), ("repetition_penalty", 0.0), ("seed", 1.5), ("max_tokens", 0),
              ("min_tokens", -1), ("logprobs", -1), ("stop", [""]), ("logit_bias", {"x": 1.0})]


def test_every_code_has_an_answer():
    for code in ErrorCode:
        err = rebuild(code.value, "why", "n" if code is ErrorCode.INVALID_REQUEST else None)
        assert err.code is code and engine_error(err).status_code in (400, 500, 503)


def test_an_invalid_field_is_a_400_naming_the_client_field():
    err = engine_error(InvalidRequest("max_tokens", "must be >= 1, got 0"), {"max_tokens": "max_new_tokens"},
                       "sampling_params.")
    assert (err.status_code, err.type, err.code) == (400, "invalid_request_error", None)
    assert err.param == "sampling_params.max_new_tokens"
    assert err.message == "max_new_tokens must be >= 1, got 0"


def test_a_dead_engine_is_a_500_with_its_code():
    err = engine_error(EngineDeadError("the engine process exited with status 1"))
    assert (err.status_code, err.code, err.param) == (500, "engine_dead", None)
    assert "exited with status 1" in err.message


def test_sampling_params_errors_carry_their_field(seed):
    field, value = random.choice(BAD_PARAMS)
    with pytest.raises(InvalidRequest) as info:
        SamplingParams(**{field: value})
    assert info.value.field == field and str(info.value).startswith(field)
    assert isinstance(info.value, ValueError)  # callers that catch ValueError still do


def test_context_errors_name_the_field(seed):
    max_len = random.randint(8, 64)
    prompt = random.randint(1, max_len)
    room = max_len - prompt + 1
    check_context(prompt, room, max_len)
    for args, field in [((max_len + 1, None, max_len), "prompt"), ((prompt, room + 1, max_len), "max_tokens"),
                        ((prompt, None, max_len, room + 1), "min_tokens")]:
        with pytest.raises(InvalidRequest) as info:
            check_context(*args)
        assert info.value.field == field


def test_a_rejection_crosses_the_wire_as_its_parts(seed):
    sent = InvalidRequest(random.choice(BAD_PARAMS)[0], f"must be fixed ({random.random()})")
    raw = wire.encoder.encode(wire.Rejected("r1", sent.code.value, sent.detail, sent.field))
    msg = wire.from_engine_decoder.decode(raw)
    got = rebuild(msg.code, msg.detail, msg.field)
    assert isinstance(got, InvalidRequest) and (got.field, got.detail, str(got)) == (sent.field, sent.detail, str(sent))
    with pytest.raises(ValueError):
        rebuild("no_such_code", "x", None)
    assert issubclass(EngineDeadError, EngineError)
