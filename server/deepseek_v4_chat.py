"""DeepSeek-V4's chat encoding. Its checkpoints ship no Jinja template: the encoding is Python in the
model repository (``encoding/encoding_dsv4.py``; SGLang serves it as
``python/sglang/srt/entrypoints/openai/encoding_dsv4.py``). This is that encoding for what an OpenAI
chat request says:

- the prompt opens with ``<｜begin▁of▁sentence｜>``; a system message is its content, then the tools
  offered (a "## Tools" section that shows the DSML call format and lists each function as a JSON
  line); without a system message the tools go into an empty one put first, as SGLang serves them;
- a user (or developer) message is ``<｜User｜>`` and its content; V4 has no tool role: the results
  that follow an assistant's calls, and the user messages after them, join into one user message of
  ``<tool_result>...</tool_result>`` and text blocks (blank lines between), the results in the
  order of the calls;
- a user message that an assistant answers, or the last, is followed by ``<｜Assistant｜>`` and
  ``<think>`` in thinking mode (on the last, or on every one where earlier reasoning is kept), else
  ``</think>``;
- an assistant message is its reasoning closed by ``</think>`` (thinking mode; dropped from turns
  before the last user message unless tools are offered), its content, its calls as a DSML block
  after a blank line, and ``<｜end▁of▁sentence｜>``.

Thinking mode is ``chat_template_kwargs`` ``thinking`` or ``enable_thinking`` true; the default is
chat, as SGLang's. Without ``add_generation_prompt`` the last user message is not followed by the
assistant's opening.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK, END_THINK = "<think>", "</think>"
DSML = "｜DSML｜"

TOOLS_SECTION = f"""## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<{DSML}tool_calls>" block like the following:

<{DSML}tool_calls>
<{DSML}invoke name="$TOOL_NAME">
<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML}parameter>
...
</{DSML}invoke>
<{DSML}invoke name="$TOOL_NAME2">
...
</{DSML}invoke>
</{DSML}tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {THINK}), you MUST output your complete reasoning inside {THINK}...{END_THINK} BEFORE any tool calls or final response.

Otherwise, output directly after {END_THINK} with tool calls or final response.

### Available Tool Schemas

{{schemas}}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _tools(tools: list[dict]) -> str:
    return TOOLS_SECTION.replace("{schemas}", "\n".join(_json(t["function"]) for t in tools))


def _parameters(arguments: Any) -> str:
    """A call's arguments as DSML parameters: a string as is, any other value as JSON; arguments
    that are not a JSON object are one parameter named ``arguments``."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass
    if not isinstance(arguments, Mapping):
        arguments = {"arguments": arguments if isinstance(arguments, str) else _json(arguments)}
    return "\n".join(f'<{DSML}parameter name="{k}" string="{"true" if isinstance(v, str) else "false"}">'
                     f'{v if isinstance(v, str) else _json(v)}</{DSML}parameter>' for k, v in arguments.items())


def _calls(calls: list[dict]) -> str:
    invokes = "\n".join(f'<{DSML}invoke name="{c["function"]["name"]}">\n{_parameters(c["function"]["arguments"])}\n'
                        f'</{DSML}invoke>' for c in calls)
    return f"\n\n<{DSML}tool_calls>\n{invokes}\n</{DSML}tool_calls>"


def _merged(messages: list[dict]) -> list[dict]:
    """Tool results into user messages of blocks (with the user messages that follow them), each
    message's results in the order of the calls before them."""
    out: list[dict] = []
    order: dict[str, int] = {}
    for m in messages:
        role = m["role"]
        if role == "assistant" and m.get("tool_calls"):
            order = {c.get("id"): k for k, c in enumerate(m["tool_calls"]) if c.get("id")}
        if role in ("tool", "user"):
            block = (("result", m.get("tool_call_id"), m.get("content") or "") if role == "tool"
                     else ("text", None, m.get("content") or ""))
            if out and "blocks" in out[-1]:
                out[-1]["blocks"].append(block)
            else:
                out.append({"role": "user", "blocks": [block]})
            out[-1]["order"] = order
        else:
            out.append(dict(m))
    for m in out:
        if "blocks" in m:  # results in call order; text blocks keep their places
            results = iter(sorted((b for b in m["blocks"] if b[0] == "result"), key=lambda b: m["order"].get(b[1], 0)))
            m["blocks"] = [next(results) if b[0] == "result" else b for b in m["blocks"]]
    return out


class DeepSeekV4Chat:
    """Renders chats as DeepSeek-V4 was trained on them; see the module docstring."""

    source = TOOLS_SECTION  # what it writes, where --tool-call-parser and --reasoning-parser auto look

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               tools: list[dict] | None = None, **template_kwargs: Any) -> str:
        thinking = any(template_kwargs.get(k) is True for k in ("thinking", "enable_thinking"))
        messages = [dict(m) for m in messages]
        if tools:
            if not messages or messages[0]["role"] != "system":
                messages.insert(0, {"role": "system", "content": ""})
            messages[0]["tools"] = tools
        messages = _merged(messages)
        keep_reasoning = bool(tools)
        last_user = max((k for k, m in enumerate(messages) if m["role"] in ("user", "developer")), default=-1)
        if thinking and not keep_reasoning:  # developer messages before the last user's go with earlier reasoning
            messages = [m for k, m in enumerate(messages) if m["role"] != "developer" or k >= last_user]
            last_user = max((k for k, m in enumerate(messages) if m["role"] in ("user", "developer")), default=-1)
        out = [BOS]
        for k, m in enumerate(messages):
            out.append(self._message(m, thinking and (keep_reasoning or k > last_user)))
            answered = k + 1 < len(messages) and messages[k + 1]["role"] == "assistant"
            if m["role"] in ("user", "developer") and (answered or (k == len(messages) - 1 and add_generation_prompt)):
                opens = thinking and (keep_reasoning or k >= last_user)
                out.append(ASSISTANT + (THINK if opens else END_THINK))
        return "".join(out)

    @staticmethod
    def _message(m: dict, with_reasoning: bool) -> str:
        role, content = m["role"], m.get("content") or ""
        if role == "system":
            return content + ("\n\n" + _tools(m["tools"]) if m.get("tools") else "")
        if role == "developer":
            return USER + content
        if role == "user":
            return USER + "\n\n".join(f"<tool_result>{text}</tool_result>" if kind == "result" else text
                                      for kind, _, text in m["blocks"])
        reasoning = (m.get("reasoning_content") or "") + END_THINK if with_reasoning else ""
        return reasoning + content + (_calls(m["tool_calls"]) if m.get("tool_calls") else "") + EOS
