"""Tool calls in a model's output: the markup a format wraps them in, read back into calls as they stream.

A format marks each call between a start and an end string, and some put a block around the calls
(DeepSeek's ``<｜tool▁calls▁begin｜>``). ``CallScanner`` reads the text as it grows and hands out only
what is decided: text before a call is content; a call's name once its header has arrived (the
format's ``header``), then its arguments' text piece by piece as the model writes them (the
format's ``arguments``), as OpenAI streams calls. It holds back a tail that could still begin a
marker or close the arguments, so a stream's deltas add up to the answer read at once (the
non-streamed answer is one ``feed`` with ``final``), for every way of cutting the text.

A call whose header reads and names an offered tool is a call from then on (its name has gone
out): its arguments are the text the model wrote, which, as OpenAI's own, need not be valid JSON
(forced calls are: their grammar holds them to the tool's schema). A call whose header does not read
as it streams (another key order, arguments written as a JSON string) is read whole once it closes.
A call that does not read at all (an unknown function, arguments that are not a JSON object, a
broken marker) stays in the content as the model wrote it (a block's own markers do not); a call left
open at the end is read as if it had closed. Whitespace between the content and the calls is dropped.

A format also says how to force calls with xgrammar's structural tags: ``structural_tag`` gives
the calls of ``tool_choice`` ``required`` (one or more of the tools) or a named function, each
call's arguments constrained by its tool's JSON schema.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar

# JSON arguments are written with at most this much whitespace between tokens: where whitespace may
# run on, a weak model can fill the gaps until max_tokens (as core/structured/compiler.py's JSON)
MAX_WHITESPACE = 1


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text


@dataclass(frozen=True)
class CallDelta:
    """A piece of call ``index``: its name (once, first), or a piece of its arguments' text."""

    index: int
    name: str | None = None
    arguments: str = ""


def joined_calls(deltas: list[CallDelta]) -> list[ToolCall]:
    """The calls that ``deltas`` (all of a completion's, in order) add up to."""
    names: dict[int, str] = {}
    args: dict[int, str] = {}
    for d in deltas:
        if d.name is not None:
            names[d.index] = d.name
        args[d.index] = args.get(d.index, "") + d.arguments
    return [ToolCall(names[i], args.get(i, "")) for i in sorted(names)]


def arguments_text(value: Any) -> str | None:
    """The JSON text of a call's arguments if they are a JSON object, else None."""
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


def json_schema_format(parameters: dict | None, style: str = "json") -> dict:
    """A structural-tag element for one tool's arguments (no schema: any JSON object)."""
    element = {"type": "json_schema", "json_schema": parameters if parameters is not None else {"type": "object"},
               "style": style}
    if style == "json":
        element["max_whitespace_cnt"] = MAX_WHITESPACE
    return element


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


class ToolCallFormat:
    """One model family's tool-call markup. Subclasses set the markers, the header of a call's body
    (``HEADER``: a regex whose ``name`` group is the function, ending where the arguments begin), and
    read one call's body whole; the arguments here are a JSON object written as is, closed by
    ``trailer`` (Hermes' outer ``}``, DeepSeek-V3's fence) before the call's end marker."""

    name: ClassVar[str]
    block_start: ClassVar[str | None] = None  # around all the calls, if the format has a block
    block_end: ClassVar[str | None] = None
    call_start: ClassVar[str]
    call_end: ClassVar[str]
    separator: ClassVar[str] = ""  # between forced calls
    template_markers: ClassVar[tuple[str, ...]] = ()  # all in a chat template: it writes this format
    HEADER: ClassVar[re.Pattern]
    trailer: ClassVar[str] = ""

    def header(self, body: str) -> tuple[str, int] | None:
        """(function name, where its arguments begin in ``body``) once ``body`` (a call's text so far)
        begins with a header that reads; None until then, or if it never will."""
        m = self.HEADER.match(body)
        return (m["name"].strip(), m.end()) if m else None

    def arguments(self, text: str, closed: bool) -> str:
        """The arguments' text decided by ``text`` (the call's text after its header, up to its end
        marker): all of it once the call has ``closed``; before, less its trailing whitespace and
        whatever may be the trailer."""
        if not closed:
            held = set(self.trailer) | {" ", "\n", "\t", "\r"}
            end = len(text)
            while end and text[end - 1] in held:
                end -= 1
            return text[:end]
        text = text.rstrip()
        if self.trailer and text.endswith(self.trailer) and not _is_json(text):
            text = text[:-len(self.trailer)].rstrip()
        return text

    def read_call(self, body: str) -> tuple[str, dict] | None:
        """(function name, arguments) of the text between a call's markers; None if it does not read."""
        raise NotImplementedError

    def call_tag(self, name: str, parameters: dict | None) -> dict:
        """The structural tag of one call of ``name``, its arguments held to ``parameters``."""
        raise NotImplementedError

    def wrap_calls(self, calls: dict) -> dict:
        """The structural tag around forced calls (the block, where the format has one)."""
        if self.block_start is None:
            return calls
        return {"type": "tag", "begin": self.block_start, "content": calls, "end": self.block_end}

    def structural_tag(self, tools: dict[str, dict | None], forced: str | None, parallel: bool,
                       prefix: dict | None = None) -> dict:
        """xgrammar's structural tag forcing calls: of ``forced`` once, else one or more of ``tools``
        (name -> JSON schema of its parameters; only one where not ``parallel``), after ``prefix``
        (the reasoning a model writes first)."""
        if forced is not None:
            calls = self.call_tag(forced, tools[forced])
        else:
            calls = {"type": "tags_with_separator", "tags": [self.call_tag(n, p) for n, p in tools.items()],
                     "separator": self.separator, "at_least_one": True, "stop_after_first": not parallel}
        fmt = self.wrap_calls(calls)
        if prefix is not None:
            fmt = {"type": "sequence", "elements": [prefix, fmt]}
        return {"type": "structural_tag", "format": fmt}

    def scanner(self, names: set[str], max_calls: int | None = None) -> "CallScanner":
        return CallScanner(self, names, max_calls)


def marker_prefix_len(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker`` (what may still become it)."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


@dataclass
class _OpenCall:
    start: int  # where its start marker is in the text
    index: int | None = None  # once its header has read (its name has gone out)
    args_at: int = 0  # where its arguments begin in the text
    sent: int = 0  # how much of its arguments has gone out


@dataclass
class CallScanner:
    """Reads one completion's text as it grows; see the module docstring."""

    fmt: ToolCallFormat
    names: set[str]
    max_calls: int | None = None  # past it (parallel_tool_calls false), markup is content
    pos: int = 0  # text before it is decided
    in_block: bool = False
    pending_space: str = ""  # whitespace at the end of the content: dropped if a call follows, or ends the text after calls
    count: int = 0  # calls so far
    open: _OpenCall | None = None  # the call being read

    def feed(self, text: str, final: bool) -> tuple[str, list[CallDelta]]:
        """The content and the pieces of calls decided since the last feed; ``text`` is all the text so far."""
        content: list[str] = []
        deltas: list[CallDelta] = []
        while self.pos < len(text):
            if self._full() and not self.in_block:
                self._content(content, text[self.pos:])
                self.pos = len(text)
            elif self.in_block:
                if not self._in_block(text, final, content, deltas):
                    break
            elif not self._outside(text, final, content, deltas):
                break
        if final:
            if not self.count:
                content.append(self.pending_space)
            self.pending_space = ""
        return "".join(content), deltas

    def _full(self) -> bool:
        """No call may begin (the open one, already counted, goes on)."""
        return self.open is None and self.max_calls is not None and self.count >= self.max_calls

    def _content(self, out: list[str], piece: str) -> None:
        """Take content, holding back its trailing whitespace until something follows it."""
        if not piece:
            return
        body = piece.rstrip()
        if body:
            out.append(self.pending_space + body)
            self.pending_space = piece[len(body):]
        else:
            self.pending_space += piece

    def _outside(self, text: str, final: bool, content: list[str], deltas: list[CallDelta]) -> bool:
        f = self.fmt
        opener = f.block_start or f.call_start
        i = text.find(opener, self.pos)
        if i < 0:
            end = len(text) if final else len(text) - marker_prefix_len(text[self.pos:], opener)
            self._content(content, text[self.pos:end])
            self.pos = end
            return False
        self._content(content, text[self.pos:i])
        if f.block_start is None:
            return self._call(text, i, final, content, deltas)
        self.pos = i + len(opener)
        self.in_block = True
        return True

    def _in_block(self, text: str, final: bool, content: list[str], deltas: list[CallDelta]) -> bool:
        f = self.fmt
        if self._full():  # no more calls: the rest of the block is content, its end a marker
            k = text.find(f.block_end, self.pos)
            end = k if k >= 0 else len(text) if final else len(text) - marker_prefix_len(text[self.pos:], f.block_end)
            self._content(content, text[self.pos:end])
            if k >= 0:
                self.pending_space = ""  # before the block's end
            self.pos = end if k < 0 else k + len(f.block_end)
            self.in_block = k < 0
            return k >= 0
        p = q = self.pos
        while q < len(text) and text[q].isspace():
            q += 1
        rest = text[q:]
        if rest.startswith(f.block_end):  # whitespace before a marker is dropped
            self.pos = q + len(f.block_end)
            self.in_block = False
            self.pending_space = ""
            return True
        if rest.startswith(f.call_start):
            self._content(content, text[p:q])  # held: dropped if the call reads
            return self._call(text, q, final, content, deltas)
        if not final and (f.block_end.startswith(rest) or f.call_start.startswith(rest)):
            return False  # may still become a marker
        # text in the block that is no call: content (its whitespace too), up to the next marker
        stops = [k for k in (text.find(f.call_start, q), text.find(f.block_end, q)) if k >= 0]
        if stops:
            end = min(stops)
        else:
            end = len(text) if final else len(text) - max(marker_prefix_len(rest, f.call_start),
                                                           marker_prefix_len(rest, f.block_end))
        self._content(content, text[p:end])
        self.pos = end
        return bool(stops) or final

    def _call(self, text: str, i: int, final: bool, content: list[str], deltas: list[CallDelta]) -> bool:
        f = self.fmt
        if self.open is None or self.open.start != i:
            self.open = _OpenCall(i)
        call = self.open
        body_start = i + len(f.call_start)
        j = text.find(f.call_end, body_start)
        closed = j >= 0 or final
        # a call's text ends at its end marker, or where one may be beginning (at the end: cut short)
        stop = j if j >= 0 else len(text) - marker_prefix_len(text[body_start:], f.call_end)
        if call.index is None:
            head = f.header(text[body_start:stop])
            if head is not None and head[0] in self.names:
                call.index, call.args_at = self.count, body_start + head[1]
                self.count += 1
                self.pending_space = ""
                deltas.append(CallDelta(call.index, name=head[0]))
        if call.index is not None:
            args = f.arguments(text[call.args_at:stop], closed)
            if len(args) > call.sent:
                deltas.append(CallDelta(call.index, arguments=args[call.sent:]))
                call.sent = len(args)
        if not closed:
            self.pos = i
            return False  # open: its end decides the rest
        if call.index is None:
            whole = self._read(text[body_start:stop])
            if whole is None:
                self._content(content, text[i:stop if j < 0 else j + len(f.call_end)])
            else:
                deltas += [CallDelta(self.count, name=whole.name), CallDelta(self.count, arguments=whole.arguments)]
                self.count += 1
                self.pending_space = ""
        self.open = None
        self.pos = len(text) if j < 0 else j + len(f.call_end)
        return True

    def _read(self, body: str) -> ToolCall | None:
        try:
            read = self.fmt.read_call(body)
        except (ValueError, TypeError):  # json.JSONDecodeError is a ValueError
            return None
        if read is None or read[0] not in self.names:
            return None
        args = arguments_text(read[1])
        return None if args is None else ToolCall(read[0], args)
