"""Tool-call formats by name (``--tool-call-parser``), and the one a model's chat template writes."""

from __future__ import annotations

from .base import CallDelta, CallScanner, ToolCall, ToolCallFormat, joined_calls
from .deepseek_v3 import DeepSeekV31Format, DeepSeekV3Format
from .deepseek_v32 import DeepSeekV32Format
from .deepseek_v4 import DeepSeekV4Format
from .hermes import HermesFormat

# the most specific first: detection takes the first whose markers are all in the template
FORMATS: dict[str, ToolCallFormat] = {f.name: f for f in (DeepSeekV32Format(), DeepSeekV4Format(), DeepSeekV3Format(),
                                                          DeepSeekV31Format(), HermesFormat())}
ALIASES = {"qwen3": "hermes", "qwen25": "hermes", "deepseekv3": "deepseek_v3", "deepseekv31": "deepseek_v31",
           "deepseekv32": "deepseek_v32",
           "deepseekv4": "deepseek_v4"}


def tool_call_format(name: str) -> ToolCallFormat:
    """The format called ``name``; ValueError listing the known ones."""
    key = ALIASES.get(name, name)
    if key not in FORMATS:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(sorted([*FORMATS, *ALIASES]))}")
    return FORMATS[key]


def detect_tool_call_format(chat_template: str | None, added_tokens: list[str] = ()) -> ToolCallFormat | None:
    """The format the chat template writes tool calls in, or whose markers are the tokenizer's added
    tokens (DeepSeek-V4 ships its encoding as Python, not as a template); None if neither says."""
    text = (chat_template or "") + "\n".join(added_tokens)
    return next((f for f in FORMATS.values() if all(m in text for m in f.template_markers)), None)


def serving_tool_format(choice: str, chat_template: str | None, added_tokens: list[str]) -> ToolCallFormat | None:
    """``--tool-call-parser``: a format by name, ``none``, or ``auto`` (detected; None if nothing says)."""
    if choice == "none":
        return None
    if choice == "auto":
        return detect_tool_call_format(chat_template, added_tokens)
    return tool_call_format(choice)


__all__ = ["CallDelta", "CallScanner", "FORMATS", "ToolCall", "ToolCallFormat", "detect_tool_call_format", "serving_tool_format",
           "tool_call_format", "joined_calls"]
