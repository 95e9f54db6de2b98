"""DeepSeek-V3's and V3.1's tool calls, in a block of calls between special markers:

V3 (and R1): ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>``
V3.1:        ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>``
"""

from __future__ import annotations

import json
import re

from .base import ToolCallFormat, json_schema_format

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"


class _DeepSeekBlock(ToolCallFormat):
    block_start = CALLS_BEGIN
    block_end = CALLS_END
    call_start = CALL_BEGIN
    call_end = CALL_END


class DeepSeekV3Format(_DeepSeekBlock):
    name = "deepseek_v3"
    separator = "\n"
    template_markers = (CALLS_BEGIN, "function" + SEP, "```json")
    HEADER = re.compile(r"\s*function" + SEP + r"(?P<name>[^\n]+)\n```(?:json)?\n\s*(?=\{)")
    trailer = "```"
    _BODY = re.compile(r"\s*function" + SEP + r"(?P<name>[^\n]+)\n```(?:json)?\n(?P<args>.*)\n```\s*", re.DOTALL)

    def read_call(self, body: str) -> tuple[str, dict] | None:
        m = self._BODY.fullmatch(body)
        return (m["name"].strip(), json.loads(m["args"])) if m else None

    def call_tag(self, name: str, parameters: dict | None) -> dict:
        return {"type": "tag", "begin": f"{CALL_BEGIN}function{SEP}{name}\n```json\n",
                "content": json_schema_format(parameters), "end": f"\n```{CALL_END}"}


class DeepSeekV31Format(_DeepSeekBlock):
    name = "deepseek_v31"
    template_markers = (CALLS_BEGIN, SEP)
    HEADER = re.compile(r"\s*(?P<name>[^<]+)" + SEP + r"\s*(?=\{)")

    def read_call(self, body: str) -> tuple[str, dict] | None:
        name, sep, args = body.partition(SEP)
        return (name.strip(), json.loads(args)) if sep and name.strip() else None

    def call_tag(self, name: str, parameters: dict | None) -> dict:
        return {"type": "tag", "begin": f"{CALL_BEGIN}{name}{SEP}", "content": json_schema_format(parameters),
                "end": CALL_END}
