"""What a request asks its output to match, shaped like vLLM's ``StructuredOutputsParams``.

Exactly one of ``json`` (a JSON schema), ``json_object`` (any JSON object), ``regex``, ``choice``
(one of the strings), ``grammar`` (EBNF, as xgrammar reads it) or ``structural_tag`` (xgrammar's
structural tag, JSON text: how tool calls are forced into a model's own call format) is set. ``source`` is the request
field it came from (``response_format.json_schema.schema``, ``guided_regex``, ...), so a grammar
that fails to compile is refused naming what the client sent.
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass

from ..errors import InvalidRequest

KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass
class StructuredOutputsParams:
    json: str | None = None  # a JSON schema, as JSON text (a mapping is turned into its text)
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: str | None = None  # as JSON text (a mapping is turned into its text)
    source: str | None = None  # the request field it came from; None: ``structured_outputs.<kind>``

    def __post_init__(self) -> None:
        if isinstance(self.json, (dict, bool)):
            self.json = _json.dumps(self.json, sort_keys=True, ensure_ascii=False)
        if isinstance(self.structural_tag, dict):
            self.structural_tag = _json.dumps(self.structural_tag, ensure_ascii=False)
        set_ = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise InvalidRequest(self.source or "structured_outputs",
                                 f"must set exactly one of {', '.join(KINDS)}; got {', '.join(set_) or 'none'}")
        self._check_types()

    def _check_types(self) -> None:
        kind, value = self.kind, self.value
        if kind == "choice":
            if not (isinstance(value, list) and value and all(isinstance(c, str) for c in value)):
                raise InvalidRequest(self.field, f"must be a non-empty list of strings, got {value!r}")
        elif kind == "json_object":
            if value is not True:
                raise InvalidRequest(self.field, f"must be true or absent, got {value!r}")
        elif not isinstance(value, str):
            raise InvalidRequest(self.field, f"must be a string, got {type(value).__name__}")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def value(self):
        return getattr(self, self.kind)

    @property
    def field(self) -> str:
        """The request field a refusal names."""
        return self.source or f"structured_outputs.{self.kind}"

    def key(self) -> tuple:
        """What identifies the grammar (the source field does not): the compile cache's key."""
        value = self.value
        return (self.kind, tuple(value) if isinstance(value, list) else value)
