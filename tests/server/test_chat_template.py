"""Chat templates render in a sandbox bounded in time and size; no template: a plain rendering."""

from __future__ import annotations

import time

import pytest

from engine.server.chat_template import RENDER_TIMEOUT_S, ChatTemplate, TemplateError

QWEN_LIKE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]


def test_renders_a_real_template():
    out = ChatTemplate(QWEN_LIKE).render(MSGS)
    assert out == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert not ChatTemplate(QWEN_LIKE).render(MSGS, add_generation_prompt=False).endswith("assistant\n")


def test_special_tokens_and_raise_exception():
    assert ChatTemplate("{{ bos_token }}{{ messages[0]['content'] }}", bos_token="<s>").render(MSGS) == "<s>Be brief."
    t = ChatTemplate("{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}")
    with pytest.raises(TemplateError, match="no system role"):
        t.render(MSGS)


def test_fallback_without_a_template():
    assert ChatTemplate(None).render(MSGS) == "system: Be brief.\nuser: hi\nassistant:"


@pytest.mark.parametrize("source", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__ }}{{ cycler.__init__.__globals__ }}",
    "{% set x = messages.append(1) %}",
])
def test_the_sandbox_refuses_internals_and_mutation(source):
    with pytest.raises(TemplateError):
        ChatTemplate(source).render(MSGS)


def test_a_runaway_loop_is_stopped_by_the_deadline():
    t = ChatTemplate("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")
    start = time.monotonic()
    with pytest.raises(TemplateError, match="longer than"):
        t.render(MSGS)
    assert time.monotonic() - start < RENDER_TIMEOUT_S + 1.0


def test_output_size_is_bounded():
    t = ChatTemplate("{% for i in range(100000) %}{{ messages[1]['content'] * 100 }}{% endfor %}")
    with pytest.raises(TemplateError, match="exceeded"):
        t.render(MSGS)


def test_tools_calls_and_tool_results_render_without_a_template():
    """(Published templates with tools: test_chat_formats.py.)"""
    from engine.server.chat_request import template_message
    from engine.server.protocol import ChatMessage

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    history = [ChatMessage.model_validate(m) for m in (
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"})]
    plain = ChatTemplate(None).render([template_message(m) for m in history], True, tools)
    assert plain.startswith("tools: [") and 'tool_call: {"name": "get_weather"' in plain and "tool: -3 C" in plain


def test_template_kwargs_reach_the_template():
    t = ChatTemplate("{% if enable_thinking is false %}off{% else %}on{% endif %}")
    assert t.render(MSGS, True, None, enable_thinking=False) == "off" and t.render(MSGS) == "on"
