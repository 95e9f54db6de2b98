"""The grammar compiler: refusals name the field, a compile past its time limit is refused and the
next one still compiles, the cache stays within its bounds over thousands of distinct grammars."""

from __future__ import annotations

import random
import string
import time

import pytest

from engine.core.errors import InvalidRequest
from engine.core.structured.compiler import GrammarCompiler
from engine.core.structured.params import StructuredOutputsParams as S
from engine.core.tokenizer import Tokenizer

pytest.importorskip("xgrammar")


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3):
    return Tokenizer.from_dir(tiny_qwen3)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    c = GrammarCompiler(tokenizer, 4096, timeout_s=30.0, cache_bytes=256 * 2**20)
    yield c
    c.shutdown()


def _matches(compiler: GrammarCompiler, compiled, tokenizer: Tokenizer, text: str) -> bool:
    """Whether ``text``, tokenized, walks the grammar to an end it may stop at."""
    m = compiler.matcher(compiled)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return all(m.accept_token(t) for t in ids) and m.accept_token(min(tokenizer.eos_token_ids))


@pytest.mark.parametrize("params, field", [
    (S(regex="(("), "structured_outputs.regex"),
    (S(json='{"type": "strin"}'), "structured_outputs.json"),
    (S(json="{not json", source="guided_json"), "guided_json"),
    (S(json={"type": "string", "pattern": "(("}, source="response_format.json_schema.schema"),
     "response_format.json_schema.schema"),
    (S(grammar="root ::= undefined_rule"), "structured_outputs.grammar"),
])
def test_a_grammar_that_does_not_compile_is_refused_naming_the_field(compiler, params, field):
    with pytest.raises(InvalidRequest) as e:
        compiler.request(params).wait()
    assert e.value.field == field and "does not compile" in e.value.detail
    t = time.monotonic()
    with pytest.raises(InvalidRequest):  # the failure is cached: refused again at once
        compiler.request(params).wait()
    assert time.monotonic() - t < 0.5


def test_params_set_exactly_one_kind():
    for bad in (dict(), dict(regex="a", choice=["a"]), dict(json_object=True, json={"type": "object"})):
        with pytest.raises(InvalidRequest, match="exactly one"):
            S(**bad)
    with pytest.raises(InvalidRequest) as e:
        S(choice=["a", 3], source="guided_choice")
    assert e.value.field == "guided_choice"


def test_each_kind_accepts_what_it_should_and_only_that(compiler, tokenizer, seed):
    rng = random.Random(seed)
    words = ["".join(rng.choice(string.ascii_letters + ' "\\\n') for _ in range(rng.randint(1, 8))) for _ in range(4)]
    choice = compiler.request(S(choice=words)).wait()
    for w in words:
        assert _matches(compiler, choice, tokenizer, w)
    assert not _matches(compiler, choice, tokenizer, words[0] + "#")
    n = rng.randint(2, 5)
    regex = compiler.request(S(regex=rf"[a-z]{{{n}}}-[0-9]+")).wait()
    assert _matches(compiler, regex, tokenizer, "x" * n + "-" + str(rng.randint(0, 999)))
    assert not _matches(compiler, regex, tokenizer, "x" * (n + 1) + "-1")
    schema = compiler.request(S(json={"type": "object", "properties": {"k": {"type": "integer", "maximum": 9}},
                                      "required": ["k"], "additionalProperties": False})).wait()
    assert _matches(compiler, schema, tokenizer, '{"k": %d}' % rng.randint(0, 9))
    assert not _matches(compiler, schema, tokenizer, '{"k": 10}')
    bounded = compiler.request(S(json={"type": "object", "properties": {"s": {"type": "string", "maxLength": 6}},
                                       "required": ["s"]})).wait()
    assert _matches(compiler, bounded, tokenizer, '{"s": "ab c"}')
    assert not _matches(compiler, bounded, tokenizer, '{"s": "a\tb"}')  # JSON has no raw control characters
    assert not _matches(compiler, bounded, tokenizer, '{"s": "abcdefg"}')
    assert not _matches(compiler, schema, tokenizer, '{\n"k": 1}')  # JSON comes on one line
    obj = compiler.request(S(json_object=True)).wait()
    assert _matches(compiler, obj, tokenizer, '{"a": [1, {"b": null}]}')
    assert not _matches(compiler, obj, tokenizer, "[1]")
    ebnf = compiler.request(S(grammar='root ::= "a" root | "b"')).wait()
    assert _matches(compiler, ebnf, tokenizer, "a" * rng.randint(0, 9) + "b")
    assert not _matches(compiler, ebnf, tokenizer, "ba")


def test_a_compile_past_its_time_limit_is_refused_and_the_next_compiles(tokenizer, seed):
    c = GrammarCompiler(tokenizer, 4096, timeout_s=0.02, cache_bytes=256 * 2**20)
    try:
        c.wait_loaded("x")
        slow = S(regex="(.{1,%d}){1,300}" % random.Random(seed).randint(290, 310), source="guided_regex")
        with pytest.raises(InvalidRequest) as e:
            c.request(slow).wait()
        assert e.value.field == "guided_regex" and "longer than" in e.value.detail
        with pytest.raises(InvalidRequest):  # the engine's poll says the same once past the limit
            c.request(slow).poll()
        c.timeout_s = 30.0
        assert c.request(S(regex="[0-9]{3}")).wait() is not None
    finally:
        c.shutdown()


def test_the_cache_stays_within_its_bounds_over_thousands_of_grammars(tokenizer, seed):
    rng = random.Random(seed)
    c = GrammarCompiler(tokenizer, 4096, timeout_s=30.0, cache_bytes=4 * 2**20, cache_entries=64)
    try:
        handles = [c.request(S(regex=f"{rng.randrange(10**9)}[a-z]{{{rng.randint(1, 9)}}}")) for _ in range(2000)]
        for h in handles:
            h.wait()
        entries, nbytes = c.cache_size
        assert entries <= 64 and nbytes <= 4 * 2**20
        assert nbytes > 0
        kept = S(json={"type": "integer"})
        first = c.request(kept).wait()
        assert c.request(kept).wait() is first  # a hit while it is among the recent ones
        for i in range(100):
            c.request(S(regex=f"x{i}")).wait()
        assert c.request(kept).wait() is not first  # evicted, compiled again
    finally:
        c.shutdown()
