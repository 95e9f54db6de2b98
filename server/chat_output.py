"""One completion's text as an assistant message: reasoning, content and tool calls.

The reasoning splitter (server/reasoning.py) takes the text first; what it leaves as content goes
to the tool-call scanner (server/tool_parsers/). Both hand out only what is decided, so ``feed``
gives the same message whether the text comes at once (``final``) or in pieces, as a stream's
deltas. Calls get their ``call_...`` ids here.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from .reasoning import ReasoningSplitter
from .tool_parsers import CallScanner, ToolCall


@dataclass
class MessageDelta:
    reasoning: str = ""
    content: str = ""
    calls: list[tuple[str, ToolCall]] = field(default_factory=list)  # (id, call)


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ChatOutputParser:
    reasoning: ReasoningSplitter | None = None
    calls: CallScanner | None = None
    num_calls: int = 0
    _content: str = ""  # all content so far, as the scanner reads it

    def feed(self, text: str, final: bool) -> MessageDelta:
        """What ``text`` (all of the completion's text so far) adds to the message."""
        out = MessageDelta()
        if self.reasoning is not None:
            out.reasoning, content = self.reasoning.feed(text, final)
        else:
            content = text[len(self._content):]
        self._content += content
        if self.calls is None:
            out.content = content
            return out
        out.content, calls = self.calls.feed(self._content, final)
        out.calls = [(call_id(), c) for c in calls]
        self.num_calls += len(calls)
        return out
