"""Tool calling through the official openai client against a live tiny-qwen3-py server (hermes
format): a named or ``required`` tool_choice forces calls whose arguments parse and validate against
the tool's schema, at temperature 1, streamed or not; a conversation with calls and tool results in
it renders; reasoning is split off in the same answer."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

MAX_TOKENS = 240  # the test server's context is 512, and the tools take 250 of it

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "days"],
                       "properties": {"city": {"type": "string", "maxLength": 12},
                                      "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                      "unit": {"enum": ["celsius", "fahrenheit"]}}}}},
    {"type": "function", "function": {
        "name": "search", "parameters": {"type": "object", "required": ["query"],
                                         "properties": {"query": {"type": "string", "pattern": "^[a-z ]{1,20}$"},
                                                        "limit": {"type": "integer", "minimum": 0}}}}},
    {"type": "function", "function": {"name": "now"}},  # no parameters: any JSON object
]
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters", {"type": "object"}) for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0, timeout=300)


def _valid(calls: list[tuple[str, str, str]], names: set[str]) -> None:
    """Each (id, name, arguments): an id, a tool offered, arguments that hold to its schema."""
    assert calls
    for call_id, name, arguments in calls:
        assert call_id.startswith("call_") and name in names
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def _streamed_calls(chunks, pieces: dict[int, int] | None = None) -> tuple[list[tuple[str, str, str]], list[str], str]:
    """The calls a stream's deltas add up to (id and name from a call's first delta, its arguments
    joined), its finish reasons, and its content; ``pieces`` counts each call's argument deltas."""
    calls: dict[int, list[str]] = {}
    pieces = {} if pieces is None else pieces
    finishes, content = [], ""
    for ch in chunks:
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or ():
            if tc.index not in calls:
                assert tc.id and tc.type == "function" and tc.function.name  # name first
                calls[tc.index] = [tc.id, tc.function.name, ""]
            else:
                assert tc.id is None and tc.function.name is None
            calls[tc.index][2] += tc.function.arguments or ""
            pieces[tc.index] = pieces.get(tc.index, 0) + bool(tc.function.arguments)
        if ch.choices[0].finish_reason:
            finishes.append(ch.choices[0].finish_reason)
    assert sorted(calls) == list(range(len(calls)))
    return [tuple(calls[i]) for i in sorted(calls)], finishes, content


@pytest.mark.parametrize("choice", ["named", "required"])
def test_forced_tool_calls_hold_to_their_schemas(tiny_server, seed, choice):
    c = _client(tiny_server)

    def run(k: int):
        name = [t["function"]["name"] for t in TOOLS][k % len(TOOLS)]
        tool_choice = {"type": "function", "function": {"name": name}} if choice == "named" else "required"
        kw = dict(model=tiny_server.model_name, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice,
                  temperature=1.0, seed=seed + k, max_tokens=MAX_TOKENS, parallel_tool_calls=k % 2 == 0)
        if k < 3:
            r = c.chat.completions.create(**kw)
            m = r.choices[0].message
            calls = [(tc.id, tc.function.name, tc.function.arguments) for tc in m.tool_calls or ()]
            return name, calls, [r.choices[0].finish_reason], m.content
        return (name, *_streamed_calls(c.chat.completions.create(stream=True, **kw)))

    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(run, range(6)))
    for k, (name, calls, finishes, content) in enumerate(results):
        if choice == "named" or k % 2 == 1:  # one call where parallel_tool_calls is false
            _valid(calls, {name} if choice == "named" else set(SCHEMAS))
            assert finishes == ["tool_calls"] and len(calls) == 1 and not content, (calls, content)
        else:  # the tiny model calls on until max_tokens (its EOS is far less likely than a newline
            # after a call, which the grammar allows as well): the call it was writing is cut short,
            # or, cut before its name, content
            assert finishes in (["tool_calls"], ["length"]), (calls, content)
            _valid(calls if finishes == ["tool_calls"] else calls[:-1], set(SCHEMAS))
            assert finishes == ["length"] or not content


def test_auto_returns_the_models_text_as_content(tiny_server, seed):
    r = _client(tiny_server).chat.completions.create(model=tiny_server.model_name, messages=MESSAGES, tools=TOOLS,
                                                     temperature=1.0, seed=seed, max_tokens=24)
    ch = r.choices[0]
    # the tiny model writes Python, not <tool_call>: its text comes back as it is
    assert ch.finish_reason in ("stop", "length") and not ch.message.tool_calls and ch.message.content


def test_a_conversation_with_calls_and_results_renders(tiny_server):
    history = [*MESSAGES,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = _client(tiny_server).chat.completions.create(
        model=tiny_server.model_name, messages=history, tools=TOOLS, max_tokens=4,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].finish_reason in ("stop", "length")


CALL_REGEX = r'Checking\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[a-z]{1,6}", "days": [1-7]\}\}\n</tool_call>'
BROKEN_REGEX = r'<tool_call>\n\{"name": "get_weather" "arguments": \{"city": "[a-z]{1,6}"\}\}\n</tool_call>'


@pytest.mark.parametrize("stream", [False, True])
def test_auto_reads_calls_and_leaves_broken_ones_as_content(tiny_server, seed, stream):
    """The model's text steered by a regex into the hermes format: a call under auto comes back as a
    call after its content (streamed: its arguments in several pieces), a broken one (no comma after
    its name) as content, never an error."""
    c = _client(tiny_server)
    results, pieces = [], {}
    for regex in (CALL_REGEX, BROKEN_REGEX):
        kw = dict(model=tiny_server.model_name, messages=MESSAGES, tools=TOOLS, tool_choice="auto", seed=seed,
                  temperature=1.0, max_tokens=MAX_TOKENS, extra_body={"guided_regex": regex})
        if stream:
            results.append(_streamed_calls(c.chat.completions.create(stream=True, **kw), pieces if regex == CALL_REGEX else None))
        else:
            r = c.chat.completions.create(**kw)
            m = r.choices[0].message
            results.append(([(tc.id, tc.function.name, tc.function.arguments) for tc in m.tool_calls or ()],
                            [r.choices[0].finish_reason], m.content))
    (calls, finishes, content), (broken_calls, broken_finishes, broken_content) = results
    assert finishes == ["tool_calls"] and content == "Checking."
    _valid(calls, {"get_weather"})
    assert broken_finishes == ["stop"] and not broken_calls
    assert broken_content.startswith('<tool_call>\n{"name": "get_weather" "arguments": {"city": ')
    assert not stream or pieces[0] > 2, pieces
