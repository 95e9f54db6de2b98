"""Structured outputs through the engine on tiny-qwen3-py: its text is noise, yet every constrained
output matches its grammar; constrained steps give the tokens they give without overlap; requests
without a grammar in the same batches draw what they draw alone."""

from __future__ import annotations

import json
import random
import re

import pytest

from engine import LLM, SamplingParams
from engine.core.errors import InvalidRequest
from engine.core.structured.params import StructuredOutputsParams as S
from random_schemas import random_schema

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

MAX_TOKENS = 700


@pytest.fixture(scope="module")
def llm(tiny_qwen3):
    return LLM(str(tiny_qwen3), progress=False, max_model_len=1024, num_pages=512)


def _json_params(rng: random.Random, n: int) -> tuple[list[dict], list[SamplingParams]]:
    schemas = [random_schema(rng) for _ in range(n)]
    params = [SamplingParams(temperature=1.0, seed=rng.randrange(2**31), max_tokens=MAX_TOKENS,
                             structured_outputs=S(json=s)) for s in schemas]
    return schemas, params


def test_json_schema_outputs_parse_and_validate(llm, seed):
    rng = random.Random(seed)
    schemas, params = _json_params(rng, 6)
    params.append(SamplingParams(temperature=1.0, seed=3, max_tokens=MAX_TOKENS, structured_outputs=S(json_object=True)))
    outs = llm.generate(["{", "def f(x):", "data = ", "[", "# config", "x", "{"], params)
    for schema, out in zip(schemas, outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (schema, c.text)
        jsonschema.validate(json.loads(c.text), schema)
    last = outs[-1].outputs[0]
    assert last.finish_reason == "stop" and isinstance(json.loads(last.text), dict)


def test_regex_choice_and_grammar_hold_beside_free_requests(llm, seed):
    rng = random.Random(seed)
    words = ["".join(rng.choice("abc xyz") for _ in range(rng.randint(1, 5))) for _ in range(3)]
    n = rng.randint(1, 4)
    regex = rf"[a-z]{{{n}}}-[0-9]{{2,4}}"
    free = SamplingParams(temperature=1.0, seed=rng.randrange(2**31), max_tokens=24, ignore_eos=True)
    params = [SamplingParams(temperature=1.0, seed=rng.randrange(2**31), max_tokens=60, structured_outputs=S(regex=regex)),
              SamplingParams(temperature=0, max_tokens=60, structured_outputs=S(choice=words)),
              SamplingParams(temperature=1.0, n=2, seed=rng.randrange(2**31), max_tokens=60,
                             structured_outputs=S(grammar='root ::= ("ab" | "c"){1,5} "!"')),
              free]
    outs = llm.generate(["x", "y", "z", "def g():"], params)
    assert re.fullmatch(regex, outs[0].outputs[0].text) and outs[0].outputs[0].finish_reason == "stop"
    assert outs[1].outputs[0].text in words
    for c in outs[2].outputs:
        assert re.fullmatch(r"(ab|c){1,5}!", c.text) and c.finish_reason == "stop"
    alone = llm.generate(["def g():"], free)[0].outputs[0]
    assert outs[3].outputs[0].token_ids == alone.token_ids  # a seeded free request: the grammars beside it change nothing


def test_constrained_steps_give_the_tokens_of_steps_without_overlap(tiny_qwen3, llm, seed):
    rng = random.Random(seed)
    params = [SamplingParams(temperature=1.0, seed=rng.randrange(2**31), max_tokens=40,
                             structured_outputs=S(regex=r"\[[a-z0-9, ]{%d,30}\]" % rng.randint(5, 20)))
              for _ in range(3)]
    params.append(SamplingParams(temperature=0.8, seed=rng.randrange(2**31), max_tokens=30, ignore_eos=True))
    prompts = ["a", "b", "c", "def h():"]
    overlapped = llm.generate(prompts, params)
    plain = LLM(str(tiny_qwen3), progress=False, max_model_len=1024, num_pages=512, overlap_decode=False)
    reference = plain.generate(prompts, params)
    for a, b in zip(overlapped, reference):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_a_bad_grammar_is_refused_naming_the_field_and_the_engine_serves_on(llm):
    bad = SamplingParams(max_tokens=8, structured_outputs=S(json={"type": "strin"}, source="guided_json"))
    with pytest.raises(InvalidRequest) as e:
        llm.generate(["x"], bad)
    assert e.value.field == "guided_json"
    for bad_opts in (dict(min_tokens=2), dict(ignore_eos=True)):
        with pytest.raises(InvalidRequest):
            SamplingParams(max_tokens=8, structured_outputs=S(regex="a+"), **bad_opts)
    out = llm.generate(["x"], SamplingParams(max_tokens=8, structured_outputs=S(regex="ab?")))[0].outputs[0]
    assert out.text in ("a", "ab")


def test_a_grammar_that_fails_in_the_engine_is_a_failure_of_its_request(llm):
    """The engine process hands such a request back as an error (take_failures): compiled past its
    limit there on a busy host, after the API process had compiled it in time."""
    from engine.core.engine import EngineCore

    core = llm.engine
    EngineCore.add_request(core, "bad-in-engine", [5, 6], SamplingParams(max_tokens=4, structured_outputs=S(
        regex="((", source="guided_regex")))
    failures = []
    for _ in range(200):
        core.step_outputs()
        failures += core.take_failures()
        if failures:
            break
    assert [(rid, e.field) for rid, e in failures] == [("bad-in-engine", "guided_regex")]
    assert not core.has_unfinished_requests()
    core.kv_manager.check_consistency()


def test_an_abort_while_the_grammar_compiles_leaves_nothing_behind(llm):
    core = llm.engine
    core.add_request("waiting", [5, 6, 7], SamplingParams(max_tokens=4, structured_outputs=S(regex="[0-9]{1,500}q")),
                     stream=False)
    assert core.abort_request("waiting").finished
    assert not core.has_unfinished_requests() and not core._awaiting_grammar
    core.kv_manager.check_consistency()
