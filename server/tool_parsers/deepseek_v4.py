"""DeepSeek-V4's tool calls, in DSML (its published chat encoding, encoding/encoding_dsv4.py; V3.2's
writes the same calls in a ``function_calls`` block, server/tool_parsers/deepseek_v32.py):

    <｜DSML｜tool_calls>
    <｜DSML｜invoke name="NAME">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

A parameter with ``string="true"`` is raw text, any other is a JSON value; the call's arguments are
the object of its parameters, written as the published decoder writes them (``{"city": "Paris",
"days": 3}``). A string parameter streams as it is written; a JSON one goes out whole once it closes,
as a JSON string if it is not JSON, so the arguments are always a JSON object's text.
"""

from __future__ import annotations

import json
import re

from .base import ToolCallFormat, json_schema_format, marker_prefix_len

DSML = "｜DSML｜"
_PARAM = re.compile(rf'\s*<{DSML}parameter name="(?P<key>[^"]+)" string="(?P<string>true|false)">')
_PARAM_END = f"</{DSML}parameter>"


def _string(text: str) -> str:
    """``text`` escaped as inside a JSON string (escaping is per character: pieces join)."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


def _json_value(text: str) -> str:
    value = text.strip()
    try:
        json.loads(value)
    except ValueError:
        return json.dumps(text, ensure_ascii=False)
    return value


class DeepSeekV4Format(ToolCallFormat):
    name = "deepseek_v4"
    block_start = f"<{DSML}tool_calls>"
    block_end = f"</{DSML}tool_calls>"
    call_start = f'<{DSML}invoke name="'
    call_end = f"</{DSML}invoke>"
    template_markers = (DSML,)
    HEADER = re.compile(r'(?P<name>[^"]+)">')

    def arguments(self, text: str, closed: bool) -> str:
        params: list[str] = []
        pos = 0
        while (m := _PARAM.match(text, pos)) is not None:
            key = json.dumps(m["key"], ensure_ascii=False) + ": "
            end = text.find(_PARAM_END, m.end())
            if end < 0 and not closed:  # the parameter is being written
                value = text[m.end():len(text) - marker_prefix_len(text[m.end():], _PARAM_END)]
                params.append(key + ('"' + _string(value) if m["string"] == "true" else ""))
                break
            value = text[m.end():end if end >= 0 else len(text)]
            params.append(key + ('"' + _string(value) + '"' if m["string"] == "true" else _json_value(value)))
            if end < 0:
                break
            pos = end + len(_PARAM_END)
        out = "{" + ", ".join(params) if params else ""
        return (out or "{") + "}" if closed else out

    def read_call(self, body: str) -> tuple[str, dict] | None:
        return None  # every call's header reads as it streams

    def call_tag(self, name: str, parameters: dict | None) -> dict:
        return {"type": "tag", "begin": f'{self.call_start}{name}">\n',
                "content": json_schema_format(parameters, style="deepseek_xml"), "end": f"{self.call_end}\n"}

    def wrap_calls(self, calls: dict) -> dict:
        return {"type": "tag", "begin": f"{self.block_start}\n", "content": calls, "end": self.block_end}
