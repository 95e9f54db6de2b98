"""A chat request made into its prompt, and what reading its output needs.

The conversation (tool calls and tool results in it too) and the offered tools render through the
chat template with the request's ``chat_template_kwargs``; the rendered prompt says where the output's
reasoning starts (server/reasoning.py). A request whose ``tool_choice`` forces calls gets their
grammar (server/tool_use.py), and a request whose output is parsed keeps its special tokens (the
markers are often special tokens) unless it says otherwise.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from ..core.sampling_params import SamplingParams
from .chat_output import ChatOutputParser
from .chat_format import ChatRenderer
from .errors import invalid
from .protocol import ChatCompletionRequest, ChatMessage
from .reasoning import Opening, ReasoningSplitter, constraint_prefix, opening
from .tool_parsers import ToolCallFormat
from .tool_use import ToolUse, tool_use_of

THINKING_SWITCHES = ("enable_thinking", "thinking")  # Qwen3's and DeepSeek's template variables


class ToolArguments(dict):
    """A call's arguments that are a JSON object, as templates read them: a mapping (Qwen3's writes
    it with ``tojson``) that is its JSON text where a template joins it to a string (DeepSeek-V3.1's
    ``'<｜tool▁sep｜>' + arguments``) or prints it."""

    def __str__(self) -> str:
        return json.dumps(self, ensure_ascii=False)

    def __add__(self, other: str) -> str:
        return str(self) + other

    def __radd__(self, other: str) -> str:
        return other + str(self)


def template_message(m: ChatMessage) -> dict[str, Any]:
    """A message as chat templates read it: content as text, a call's arguments as ``ToolArguments``
    where they are a JSON object."""
    out: dict[str, Any] = {"role": m.role, "content": m.text}
    for key in ("name", "tool_call_id", "reasoning_content"):
        if getattr(m, key) is not None:
            out[key] = getattr(m, key)
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": c.type,
                              "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                             for c in m.tool_calls]
    return out


def _arguments(text: str) -> Any:
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return ToolArguments(value) if isinstance(value, dict) else text


@dataclass
class ChatPrompt:
    text: str
    tools: ToolUse | None
    reasoning: Opening | None  # None: the server reads no reasoning

    def sampling_params(self, params: SamplingParams, req: ChatCompletionRequest) -> SamplingParams:
        changes: dict[str, Any] = {}
        if self.tools is not None:
            grammar = self.tools.constraint(constraint_prefix(self.reasoning) if self.reasoning else None)
            if grammar is not None:
                if params.structured_outputs is not None:
                    raise invalid("tool_choice", f"tool_choice forces tool calls, and {params.structured_outputs.field} "
                                                 "constrains the output too: set one")
                changes["structured_outputs"] = grammar
        if (self.tools is not None or self.reasoning is not None) and req.skip_special_tokens is None:
            changes["skip_special_tokens"] = False
        return dataclasses.replace(params, **changes) if changes else params

    def output_parser(self) -> ChatOutputParser:
        """A fresh parser for one completion's output."""
        return ChatOutputParser(ReasoningSplitter(self.reasoning) if self.reasoning else None,
                                self.tools.scanner() if self.tools else None)


def chat_prompt(req: ChatCompletionRequest, template: ChatRenderer, tool_format: ToolCallFormat | None,
                reasoning_parser: str | None) -> ChatPrompt:
    """Render the request (in a worker thread: the template runs up to its deadline)."""
    use = tool_use_of(req, tool_format)
    kwargs = req.chat_template_kwargs or {}
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if use is not None else None
    text = template.render([template_message(m) for m in req.messages], True, tools, **kwargs)
    thinking = all(kwargs.get(k, True) is not False for k in THINKING_SWITCHES)
    return ChatPrompt(text, use, opening(text, thinking) if reasoning_parser else None)
