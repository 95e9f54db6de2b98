"""Reasoning content: the thinking a model writes between ``<think>`` and ``</think>`` before its
answer (DeepSeek-R1/V3.1/V4, Qwen3), split from the content (``--reasoning-parser``).

Where the reasoning starts is read from the rendered prompt: a template that opened ``<think>``
(DeepSeek's thinking mode) leaves the output inside it, so the output only closes it; one that
closed it (``</think>``: thinking turned off) leaves none; otherwise the output holds reasoning when
it opens with ``<think>``. Without its closing marker, all of a begun reasoning is reasoning.
``ReasoningSplitter`` reads the text as it grows and hands out only what is decided (it holds back
a tail that could begin the marker), so a stream's deltas add up to the answer read at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .tool_parsers.base import marker_prefix_len

START = "<think>"
END = "</think>"
PARSERS = ("deepseek_r1", "deepseek_v3", "deepseek_v4", "qwen3")  # all write <think>...</think>

Opening = Literal["open", "closed", "maybe"]


def reasoning_parser(name: str) -> str:
    """``name`` if it is a known reasoning parser; ValueError listing them."""
    if name not in PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(PARSERS)}")
    return name


def serving_reasoning_parser(choice: str, chat_template: str | None, added_tokens: list[str] = ()) -> str | None:
    """``--reasoning-parser``: a parser by name, ``none``, or ``auto`` (one where the chat template
    writes ``<think>`` blocks, or the tokenizer has them as tokens: DeepSeek-V4 ships no template)."""
    if choice == "none":
        return None
    if choice == "auto":
        text = (chat_template or "") + "\n".join(added_tokens)
        return "qwen3" if START in text and END in text else None
    return reasoning_parser(choice)


def opening(prompt: str, thinking: bool = True) -> Opening:
    """Where the output's reasoning stands after ``prompt``: inside it (``open``), without any
    (``closed``: the template closed it, or the request turned thinking off), or up to the output."""
    tail = prompt.rstrip()
    if tail.endswith(START) and thinking:
        return "open"
    if tail.endswith(END) or not thinking:
        return "closed"
    return "maybe"


def constraint_prefix(state: Opening) -> dict | None:
    """The structural-tag element for the reasoning before forced tool calls."""
    if state == "closed":
        return None
    if state == "open":
        return {"type": "tag", "begin": "", "content": {"type": "any_text", "excludes": [START, END]}, "end": END}
    return {"type": "optional", "content": {"type": "tag", "begin": START,
                                            "content": {"type": "any_text", "excludes": [START, END]}, "end": END}}


@dataclass
class ReasoningSplitter:
    """One completion's split into reasoning and content, fed its text as it grows."""

    state: Opening
    pos: int = 0
    phase: Literal["start", "reasoning", "content"] = "start"
    after_reasoning: bool = False  # the content's leading whitespace (after </think>) is dropped

    def __post_init__(self) -> None:
        self.phase = {"open": "reasoning", "closed": "content", "maybe": "start"}[self.state]

    def feed(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) decided since the last feed; ``text`` is all the text so far."""
        reasoning = ""
        if self.phase == "start":
            head = text[self.pos:].lstrip()
            if head.startswith(START):
                self.pos = text.index(START, self.pos) + len(START)
                self.phase = "reasoning"
            elif START.startswith(head) and not final:
                return "", ""  # may still open
            else:
                self.phase = "content"
        if self.phase == "reasoning":
            end = text.find(END, self.pos)
            if end < 0:
                stop = len(text) if final else len(text) - marker_prefix_len(text[self.pos:], END)
                reasoning, self.pos = text[self.pos:stop], stop
                return reasoning, ""
            reasoning = text[self.pos:end]
            self.pos = end + len(END)
            self.phase = "content"
            self.after_reasoning = True
        content, self.pos = text[self.pos:], len(text)
        if self.after_reasoning:
            content = content.lstrip()
            self.after_reasoning = not content
        return reasoning, content
