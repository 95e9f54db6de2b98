"""A request body, from bytes to a JSON object every route can trust the shape of.

Python's ``json`` accepts what later code cannot handle: a lone UTF-16 surrogate (``"\\ud800"``,
or raw in bytes that are not strict UTF-8, or in a UTF-16 body), which no tokenizer or encoder
takes, and nesting deep enough to exhaust the recursion limit. Bodies must be UTF-8 (RFC 8259);
the rest is refused here with a 400 (naming the field where there is one) before any route sees it.
Non-finite numbers (``Infinity``, ``1e999``) parse, and the request models refuse them per field.
"""

from __future__ import annotations

import json
import re

from .errors import APIError, invalid

_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # in strict UTF-8, the only way to spell a surrogate


def _path(parts: list) -> str | None:
    return ".".join(str(p) for p in parts) or None


def _check_strings(body: dict) -> None:
    """Walk the parsed body (iteratively: nothing to exhaust) for lone surrogates in keys and strings."""
    stack: list[tuple[object, list]] = [(body, [])]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            _check_text(value, path)
        elif isinstance(value, dict):
            for k, v in value.items():
                _check_text(k, path + [k])
                stack.append((v, path + [k]))
        elif isinstance(value, list):
            stack.extend((v, path + [i]) for i, v in enumerate(value) if isinstance(v, (str, list, dict)))


def _check_text(text: str, path: list) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        field = _path(path)
        raise invalid(field, f"{field or 'the body'} holds a lone UTF-16 surrogate, which is not text") from None


def parse_json_object(raw: bytes, content_type: str) -> dict:
    """The body as a dict, or an APIError (415 for another content type, 400 for the rest)."""
    ctype = content_type.split(";")[0].strip().lower()
    if ctype != "application/json":
        raise APIError(415, f"the body must be application/json, got {ctype or 'no content type'!r}",
                       "invalid_request_error", None, "unsupported_media_type")
    try:
        text = raw.decode("utf-8-sig")  # strict: json.loads(bytes) would let UTF-16, and surrogates, through
    except UnicodeDecodeError as exc:
        raise invalid(None, f"the body is not UTF-8 (JSON bodies must be): {exc}") from None
    try:
        body = json.loads(text)
    except RecursionError:
        raise invalid(None, "the body nests too deeply to parse") from None
    except ValueError as exc:
        raise invalid(None, f"the body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise invalid(None, f"the body must be a JSON object, got {type(body).__name__}")
    if _SURROGATE_ESCAPE.search(text):
        _check_strings(body)
    return body
