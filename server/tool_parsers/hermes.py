"""Qwen3's (Hermes-style) tool calls: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``,
one block per call."""

from __future__ import annotations

import json
import re

from .base import ToolCallFormat, json_schema_format


class HermesFormat(ToolCallFormat):
    name = "hermes"
    call_start = "<tool_call>"
    call_end = "</tool_call>"
    separator = "\n"
    template_markers = ("<tool_call>", "</tool_call>")
    HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"(?P<name>[^"\\]+)"\s*,\s*"arguments"\s*:\s*(?=\{)')
    trailer = "}"  # the call's object around the arguments

    def read_call(self, body: str) -> tuple[str, dict] | None:
        call = json.loads(body)
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        args = call.get("arguments", call.get("parameters", {}))
        if isinstance(args, str):  # some models write the arguments as a JSON string
            args = json.loads(args)
        return call["name"], args

    def call_tag(self, name: str, parameters: dict | None) -> dict:
        return {"type": "tag", "begin": f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": ',
                "content": json_schema_format(parameters), "end": "}\n</tool_call>"}
