"""What a chat request's ``tools`` and ``tool_choice`` ask of its output.

``auto`` lets the model write text or calls, read back by the tool-call format's parser; ``required``
and a named function force calls through xgrammar: a structural tag in the format's own markup,
each call's arguments held to its tool's JSON schema (so they always parse and validate), after any
reasoning the model writes first. ``none``, or no tools, leaves the output alone. Every tool's
``parameters`` must be a valid JSON schema (checked against its metaschema), whatever the choice.
"""

from __future__ import annotations

from dataclasses import dataclass

import jsonschema

from ..core.structured.params import StructuredOutputsParams
from .errors import invalid
from .protocol import ChatCompletionRequest, NamedToolChoice
from .tool_parsers import CallScanner, ToolCallFormat


@dataclass
class ToolUse:
    fmt: ToolCallFormat
    schemas: dict[str, dict | None]  # tool name -> its parameters' schema
    forced: str | None  # a named tool_choice
    required: bool  # tool_choice required (or named)
    parallel: bool  # more than one call allowed

    def scanner(self) -> CallScanner:
        return self.fmt.scanner(set(self.schemas), None if self.parallel else 1)

    def constraint(self, reasoning_prefix: dict | None) -> StructuredOutputsParams | None:
        """The grammar forcing calls, where the choice forces them."""
        if not self.required:
            return None
        tag = self.fmt.structural_tag(self.schemas, self.forced, self.parallel, reasoning_prefix)
        return StructuredOutputsParams(structural_tag=tag, source="tools")


def tool_use_of(req: ChatCompletionRequest, fmt: ToolCallFormat | None) -> ToolUse | None:
    """The request's tool use (None: no tools, or ``tool_choice`` none); a 400 naming the field where
    a schema is bad or the server reads no tool calls."""
    for i, tool in enumerate(req.tools or ()):
        schema = tool.function.parameters
        if schema is not None:
            try:
                jsonschema.validators.validator_for(schema).check_schema(schema)
            except jsonschema.SchemaError as e:
                raise invalid(f"tools.{i}.function.parameters", f"tools.{i}.function.parameters is not a valid "
                                                                f"JSON schema: {e.message}") from None
    if not req.tools or req.tool_choice == "none":
        return None
    if fmt is None:
        raise invalid("tools", "this server reads no tool calls from its model's output: start it with "
                               "--tool-call-parser NAME")
    forced = req.tool_choice.function.name if isinstance(req.tool_choice, NamedToolChoice) else None
    return ToolUse(fmt, {t.function.name: t.function.parameters for t in req.tools}, forced,
                   forced is not None or req.tool_choice == "required", req.parallel_tool_calls is not False)
