"""One completion's text as an assistant message: reasoning, content and tool calls.

The reasoning splitter (server/reasoning.py) takes the text first; what it leaves as content goes
to the tool-call scanner (server/tool_parsers/). Both hand out only what is decided, so ``feed``
gives the same message whether the text comes at once (``final``) or in pieces, as a stream's
deltas: a call's name first (with its ``call_...`` id, given here), then its arguments in pieces.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from .reasoning import ReasoningSplitter
from .tool_parsers import CallDelta, CallScanner, ToolCall, joined_calls


@dataclass
class MessageDelta:
    reasoning: str = ""
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)
    ids: dict[int, str] = field(default_factory=dict)  # the ids of the calls named here, by index

    def tool_calls(self) -> list[tuple[str, ToolCall]]:
        """(id, call) of the calls this delta holds whole (all of them, where it is the only feed)."""
        return list(zip((self.ids[i] for i in sorted(self.ids)), joined_calls(self.calls)))


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ChatOutputParser:
    reasoning: ReasoningSplitter | None = None
    calls: CallScanner | None = None
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
        out.content, out.calls = self.calls.feed(self._content, final)
        out.ids = {d.index: call_id() for d in out.calls if d.name is not None}
        return out

    @property
    def num_calls(self) -> int:
        return self.calls.count if self.calls is not None else 0
