"""Reasoning content: ``<think>`` reasoning split from the content on hand-written outputs (the
template opened it, closed it, or left it to the output), the same when streamed in random pieces;
and through a live tiny-qwen3-py server whose template opens ``<think>`` unless ``enable_thinking``
is false, its output steered by a regex, streamed or not."""

from __future__ import annotations

import json
import os
import random

import openai
import pytest

from engine.server.chat_output import ChatOutputParser
from engine.server.reasoning import ReasoningSplitter, opening, serving_reasoning_parser
from engine.server.tool_parsers import ToolCall, joined_calls, tool_call_format

pytest.importorskip("xgrammar")

# (where the prompt leaves the reasoning, output, reasoning, content)
CASES = [
    ("open", "plan it</think>\n\nthe answer", "plan it", "the answer"),
    ("open", "still thinking, cut off", "still thinking, cut off", ""),
    ("open", "x</thi", "x</thi", ""),  # a marker never finished is reasoning
    ("maybe", "<think>\nhmm\n</think>\n\nhello", "\nhmm\n", "hello"),
    ("maybe", "  <think>a</think>b", "a", "b"),
    ("maybe", "hello <think>not reasoning</think>", "", "hello <think>not reasoning</think>"),
    ("maybe", "<thin", "", "<thin"),
    ("closed", "<think>a</think>b", "", "<think>a</think>b"),
]


def _split(state, text, pieces=None, tools=False):
    scanner = tool_call_format("hermes").scanner({"f"}) if tools else None
    parser = ChatOutputParser(ReasoningSplitter(state), scanner)
    reasoning, content, deltas, so_far = "", "", [], ""
    for k, piece in enumerate(pieces or [text]):
        so_far += piece
        d = parser.feed(so_far, k == len(pieces or [text]) - 1)
        reasoning, content, deltas = reasoning + d.reasoning, content + d.content, deltas + d.calls
    return reasoning, content, joined_calls(deltas)


def _pieces(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize("state,text,reasoning,content", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_reasoning_splits_from_content_whole_and_streamed(state, text, reasoning, content, seed):
    assert _split(state, text) == (reasoning, content, [])
    rng = random.Random(seed)
    for _ in range(20):
        assert _split(state, text, _pieces(text, rng)) == (reasoning, content, [])
    assert _split(state, text, list(text)) == (reasoning, content, [])


def test_tool_calls_after_the_reasoning(seed):
    text = 'I need f.</think>\n\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    want = ("I need f.", "", [ToolCall("f", '{"a": 1}')])
    assert _split("open", text, tools=True) == want
    rng = random.Random(seed)
    for _ in range(20):
        assert _split("open", text, _pieces(text, rng), tools=True) == want


@pytest.mark.parametrize("prompt,thinking,state", [
    ("<|Assistant|><think>", True, "open"), ("<|Assistant|><think>\n", False, "closed"),
    ("assistant\n<think>\n\n</think>\n\n", True, "closed"), ("<|im_start|>assistant\n", True, "maybe"),
    ("<|im_start|>assistant\n", False, "closed"),
])
def test_the_prompt_says_where_reasoning_starts(prompt, thinking, state):
    assert opening(prompt, thinking) == state


def test_the_parser_is_detected_from_the_template():
    assert serving_reasoning_parser("auto", "{{ '<think>' }}x{{ '</think>' }}") == "qwen3"
    assert serving_reasoning_parser("auto", "{{ messages }}") is None
    assert serving_reasoning_parser("auto", None, ["<｜User｜>", "<think>", "</think>"]) == "qwen3"
    assert serving_reasoning_parser("none", "<think></think>") is None
    with pytest.raises(ValueError, match="qwen3"):
        serving_reasoning_parser("nonsense", None)


THINKING_TEMPLATE = (
    "{% for m in messages %}{{ m.role }}: {{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}\n{% endfor %}"
    "{% if tools %}tools: {{ tools | tojson }}\n{% endif %}"
    "{% if add_generation_prompt %}assistant: {% if enable_thinking is false %}<think></think>{% else %}<think>"
    "{% endif %}{% endif %}")


@pytest.fixture(scope="module")
def thinking_server(tiny_qwen3, tmp_path_factory):
    from live_server import LiveServer

    model = tmp_path_factory.mktemp("thinking-model")
    for f in os.listdir(tiny_qwen3):
        os.symlink(tiny_qwen3 / f, model / f)
    (model / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    server = LiveServer(str(model), "--max-model-len", "512", "--tool-call-parser", "hermes",
                        log=tmp_path_factory.mktemp("logs") / "thinking-server.log").wait_ready()
    yield server
    server.stop()


def _chat(server, seed, **kw):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0, timeout=300)
    return client.chat.completions.create(model=server.model_name, messages=[{"role": "user", "content": "hi"}],
                                          temperature=1.0, seed=seed, max_tokens=60, **kw)


def test_a_live_answer_splits_reasoning_streamed_or_not(thinking_server, seed):
    """The template opened <think> (the reasoning parser was detected from it): the output only
    closes it."""
    regex = "[a-z]{3,8}</think>[a-z]{2,6}"
    r = _chat(thinking_server, seed, extra_body={"guided_regex": regex})
    m = r.choices[0].message
    whole = m.model_extra["reasoning_content"] + "</think>" + m.content
    assert len(m.model_extra["reasoning_content"]) >= 3 and 2 <= len(m.content) <= 6, whole
    chunks = list(_chat(thinking_server, seed, stream=True, extra_body={"guided_regex": regex}))
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    reasoning = "".join(d.model_extra.get("reasoning_content") or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    assert (reasoning, content) == (m.model_extra["reasoning_content"], m.content)  # the same seed
    kinds = ["r" if d.model_extra.get("reasoning_content") else "c" for d in deltas if d.content
             or d.model_extra.get("reasoning_content")]
    assert kinds == sorted(kinds, reverse=True)  # reasoning deltas, then content deltas


def test_thinking_off_leaves_all_content_and_forced_calls_follow_it(thinking_server, seed):
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    r = _chat(thinking_server, seed, extra_body={"guided_regex": "[a-z]{2,6}", **off})
    assert r.choices[0].message.model_extra.get("reasoning_content") is None and r.choices[0].message.content
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}}}
    r = _chat(thinking_server, seed, tools=[tool], tool_choice="required", parallel_tool_calls=False, extra_body=off)
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "f"
    assert 0 <= json.loads(call.function.arguments)["n"] <= 9
