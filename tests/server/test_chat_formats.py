"""Published chat formats rendered and read back: Qwen3's template (tools, <tool_call> calls, tool
responses, <think> reasoning), DeepSeek-V3.1's template, and DeepSeek-V4's encoding (which ships as
Python, not as a template); each format's calls, as the format writes them into the history, read
back by its tool-call parser into the same calls, and the renderer a checkpoint gets.

tests/assets/chat_templates/ holds the published templates as llama.cpp keeps them
(github.com/ggml-org/llama.cpp, models/templates/): Qwen-Qwen3-0.6B.jinja is the chat_template of
huggingface.co/Qwen/Qwen3-0.6B's tokenizer_config.json, deepseek-ai-DeepSeek-V3.1.jinja that of
huggingface.co/deepseek-ai/DeepSeek-V3.1. DeepSeek-V4's expected prompts follow its published
encoding, encoding/encoding_dsv4.py of huggingface.co/deepseek-ai/DeepSeek-V4-Flash (as SGLang serves
it: python/sglang/srt/entrypoints/openai/encoding_dsv4.py, tools put into a first system message).
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from engine.server.chat_format import DeepSeekV4Chat, chat_renderer
from engine.server.chat_output import ChatOutputParser
from engine.server.chat_request import template_message
from engine.server.chat_template import ChatTemplate
from engine.server.deepseek_v4_chat import TOOLS_SECTION
from engine.server.protocol import ChatMessage
from engine.server.reasoning import ReasoningSplitter, opening, serving_reasoning_parser
from engine.server.tool_parsers import ToolCall, serving_tool_format, tool_call_format
from live_server import LiveServer

TEMPLATES = Path(__file__).parent.parent / "assets" / "chat_templates"
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
D = "｜DSML｜"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}


def _messages(*raw: dict) -> list[dict]:
    """Messages as a request brings them to the template (server/chat_request.py)."""
    return [template_message(ChatMessage.model_validate(m)) for m in raw]


def _call(call_id: str, city: str, days: int) -> dict:
    return {"id": call_id, "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": city, "days": days})}}


def _read(fmt: str, state: str, text: str):
    out = ChatOutputParser(ReasoningSplitter(state), tool_call_format(fmt).scanner({"get_weather"})).feed(text, True)
    return out.reasoning, out.content, [c for _, c in out.tool_calls()]


def test_qwen3_template_renders_tools_calls_reasoning_and_results():
    t = ChatTemplate((TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text())
    history = _messages({"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"},
                        {"role": "assistant", "content": None, "reasoning_content": "Look it up.",
                         "tool_calls": [_call("call_1", "Oslo", 2)]},
                        {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"})
    assistant_turn = ('<think>\nLook it up.\n</think>\n\n'
                      '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>')
    assert t.render(history, True, [WEATHER]) == (
        "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist with the user query."
        "\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        + json.dumps(WEATHER) +  # Hugging Face's tojson: keys in order, no HTML escapes
        "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
        '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}'
        "\n</tool_call><|im_end|>\n<|im_start|>user\nWeather in Oslo?<|im_end|>\n"
        "<|im_start|>assistant\n" + assistant_turn + "<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n-3 C\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    # the model writes the turn as the template does: read back, the same call and reasoning
    reasoning, content, calls = _read("hermes", "maybe", assistant_turn)
    assert reasoning.strip() == "Look it up." and content == ""
    assert calls == [ToolCall("get_weather", '{"city": "Oslo", "days": 2}')]
    off = t.render(_messages({"role": "user", "content": "hi"}), True, None, enable_thinking=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") and opening(off, False) == "closed"
    assert opening(t.render(_messages({"role": "user", "content": "hi"}))) == "maybe"
    assert serving_tool_format("auto", t.source, []).name == "hermes"
    assert serving_reasoning_parser("auto", t.source) is not None


def test_deepseek_v31_template_joins_the_arguments_as_text():
    """V3.1's template concatenates a call's arguments to strings: they reach it as their JSON text."""
    t = ChatTemplate((TEMPLATES / "deepseek-ai-DeepSeek-V3.1.jinja").read_text(), BOS, EOS)
    history = _messages({"role": "user", "content": "Weather in Oslo?"},
                        {"role": "assistant", "content": None, "tool_calls": [_call("call_1", "Oslo", 2)]},
                        {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"})
    calls_text = ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Oslo", "days": 2}'
                  "<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
    assert t.render(history, True, [WEATHER]) == (
        BOS + "<｜User｜>Weather in Oslo?<｜Assistant｜></think>" + calls_text + EOS
        + "<｜tool▁output▁begin｜>-3 C<｜tool▁output▁end｜>")
    assert _read("deepseek_v31", "closed", calls_text) == ("", "", [ToolCall("get_weather", '{"city": "Oslo", "days": 2}')])
    hi = _messages({"role": "user", "content": "hi"})
    assert t.render(hi) == BOS + "<｜User｜>hi<｜Assistant｜></think>" and opening(t.render(hi)) == "closed"
    thinking = t.render(hi, True, None, thinking=True)
    assert thinking.endswith("<｜Assistant｜><think>") and opening(thinking) == "open"
    assert serving_tool_format("auto", t.source, []).name == "deepseek_v31"


def _invoke(city: str, days: int) -> str:
    return (f'<{D}invoke name="get_weather">\n<{D}parameter name="city" string="true">{city}</{D}parameter>\n'
            f'<{D}parameter name="days" string="false">{days}</{D}parameter>\n</{D}invoke>')


def test_deepseek_v4_encoding_with_tools_calls_results_and_thinking():
    """Tools go into the system message; the tool results join one user message in the calls' order;
    with tools offered, thinking mode keeps the reasoning."""
    block = f"\n\n<{D}tool_calls>\n{_invoke('Paris', 2)}\n{_invoke('Oslo', 1)}\n</{D}tool_calls>"
    history = _messages({"role": "system", "content": "Be brief."},
                        {"role": "user", "content": "Weather in Paris and Oslo?"},
                        {"role": "assistant", "content": None, "reasoning_content": "Two cities.",
                         "tool_calls": [_call("call_1", "Paris", 2), _call("call_2", "Oslo", 1)]},
                        {"role": "tool", "tool_call_id": "call_2", "content": "-3 C"},
                        {"role": "tool", "tool_call_id": "call_1", "content": "12 C"})
    tools_section = TOOLS_SECTION.replace("{schemas}", json.dumps(WEATHER["function"]))
    assert tools_section.startswith("## Tools\n\n") and tools_section.endswith("to invoke tool calls.\n")
    assert DeepSeekV4Chat().render(history, True, [WEATHER], thinking=True) == (
        BOS + "Be brief.\n\n" + tools_section + "<｜User｜>Weather in Paris and Oslo?<｜Assistant｜><think>"
        + "Two cities.</think>" + block + EOS
        + "<｜User｜><tool_result>12 C</tool_result>\n\n<tool_result>-3 C</tool_result><｜Assistant｜><think>")
    reasoning, content, calls = _read("deepseek_v4", "open", "Two cities.</think>" + block)
    assert (reasoning, content) == ("Two cities.", "")
    assert calls == [ToolCall("get_weather", '{"city": "Paris", "days": 2}'),
                     ToolCall("get_weather", '{"city": "Oslo", "days": 1}')]
    # no system message: the tools go into an empty one put first
    assert DeepSeekV4Chat().render(_messages({"role": "user", "content": "hi"}), True, [WEATHER]) == (
        BOS + "\n\n" + tools_section + "<｜User｜>hi<｜Assistant｜></think>")


def test_deepseek_v4_encoding_drops_earlier_reasoning_and_defaults_to_chat():
    history = _messages({"role": "user", "content": "1+1?"},
                        {"role": "assistant", "content": "2", "reasoning_content": "easy"},
                        {"role": "user", "content": "and 2+2?"})
    v4 = DeepSeekV4Chat()
    assert v4.render(history, True, None, thinking=True) == (
        BOS + "<｜User｜>1+1?<｜Assistant｜></think>2" + EOS + "<｜User｜>and 2+2?<｜Assistant｜><think>")
    chat = v4.render(history, True, None)
    assert chat == BOS + "<｜User｜>1+1?<｜Assistant｜></think>2" + EOS + "<｜User｜>and 2+2?<｜Assistant｜></think>"
    assert opening(chat) == "closed" and opening(v4.render(history, True, None, enable_thinking=True)) == "open"
    assert v4.render(_messages({"role": "system", "content": "S"}, {"role": "user", "content": "hi"}), False) == (
        BOS + "S<｜User｜>hi")
    assert serving_tool_format("auto", v4.source, []).name == "deepseek_v4"
    assert serving_reasoning_parser("auto", v4.source) is not None


def test_the_renderer_a_checkpoint_gets(shared_dir, tmp_path):
    """DeepSeek-V4 (no template) gets its encoding; a model without either, plain lines; a template
    file or an encoding's name on --chat-template wins."""
    models = shared_dir / "models"
    assert isinstance(chat_renderer(None, models / "tiny-dsv4-py", None), DeepSeekV4Chat)
    plain = chat_renderer(None, models / "tiny-qwen3-py", None)
    assert isinstance(plain, ChatTemplate) and plain.render(_messages({"role": "user", "content": "hi"})) == (
        "user: hi\nassistant:")
    assert isinstance(chat_renderer("deepseek_v4", models / "tiny-qwen3-py", None), DeepSeekV4Chat)
    jinja = tmp_path / "t.jinja"
    jinja.write_text("{{ messages[0].content }}!")
    for model in ("tiny-dsv4-py", "tiny-qwen3-py"):
        assert chat_renderer(str(jinja), models / model, None).render(_messages({"role": "user", "content": "hi"})) == "hi!"
    assert chat_renderer(None, models / "tiny-dsv4-py", "{{ 'own' }}").render([]) == "own"  # the tokenizer's template


def test_the_chat_template_flag():
    import argparse

    from engine.server.serve_args import add_serve_args

    p = argparse.ArgumentParser()
    add_serve_args(p)
    assert p.parse_args(["--chat-template", "deepseek_v4"]).chat_template == "deepseek_v4"
    assert p.parse_args([]).chat_template is None
    with pytest.raises(SystemExit):
        p.parse_args(["--chat-template", "/no/such/template.jinja"])


def test_a_served_template_file_renders_and_its_calls_read_back(tiny_qwen3, tmp_path):
    """``--chat-template`` with Qwen3's published template on tiny-qwen3-py (which has none): prompts
    are that template's, the hermes parser is found from it (without one, tools are a 400), and a
    forced call in its format comes back as a call."""
    qwen3 = TEMPLATES / "Qwen-Qwen3-0.6B.jinja"
    server = LiveServer(str(tiny_qwen3), "--max-model-len", "1024", "--chat-template", str(qwen3),
                        log=tmp_path / "server.log").wait_ready()
    try:
        post = lambda path, body: httpx.post(server.url + path, json={"model": server.model_name, **body},  # noqa: E731
                                             headers=server.headers, timeout=120)
        hi = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
        ids = post("/tokenize", {"messages": hi}).json()["tokens"]
        assert post("/detokenize", {"tokens": ids}).json()["prompt"] == ChatTemplate(qwen3.read_text()).render(
            _messages(*hi))
        res = post("/v1/chat/completions", {
            "messages": hi, "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "max_tokens": 80, "temperature": 1.0, "seed": 0, "chat_template_kwargs": {"enable_thinking": False}})
        assert res.status_code == 200, res.text
        choice = res.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None, choice
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather" and isinstance(json.loads(call["function"]["arguments"]), dict)
    finally:
        server.stop()
