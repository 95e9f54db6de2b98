"""DeepSeek-V4's tool calls, in DSML (its published chat encoding, as V3.2's with ``tool_calls``):

    <｜DSML｜tool_calls>
    <｜DSML｜invoke name="NAME">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

A parameter with ``string="true"`` is raw text, any other is a JSON value; the call's arguments are
the object of its parameters.
"""

from __future__ import annotations

import json
import re

from .base import ToolCallFormat, json_schema_format

DSML = "｜DSML｜"
_PARAM = re.compile(rf'\s*<{DSML}parameter name="(?P<key>[^"]+)" string="(?P<string>true|false)">(?P<value>.*?)'
                    rf'</{DSML}parameter>', re.DOTALL)


class DeepSeekV4Format(ToolCallFormat):
    name = "deepseek_v4"
    block_start = f"<{DSML}tool_calls>"
    block_end = f"</{DSML}tool_calls>"
    call_start = f'<{DSML}invoke name="'
    call_end = f"</{DSML}invoke>"
    template_markers = (DSML,)

    def read_call(self, body: str) -> tuple[str, dict] | None:
        name, sep, params = body.partition('">')
        if not sep or not name:
            return None
        args: dict = {}
        pos = 0
        while (m := _PARAM.match(params, pos)) is not None:
            if m["key"] in args:
                return None
            args[m["key"]] = m["value"] if m["string"] == "true" else json.loads(m["value"])
            pos = m.end()
        return (name, args) if not params[pos:].strip() else None

    def call_tag(self, name: str, parameters: dict | None) -> dict:
        return {"type": "tag", "begin": f'{self.call_start}{name}">\n',
                "content": json_schema_format(parameters, style="deepseek_xml"), "end": f"{self.call_end}\n"}

    def wrap_calls(self, calls: dict) -> dict:
        return {"type": "tag", "begin": f"{self.block_start}\n", "content": calls, "end": self.block_end}
