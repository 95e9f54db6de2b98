"""Errors the HTTP API answers with, in the body shape OpenAI clients parse."""

from __future__ import annotations


class APIError(Exception):
    """A failed request: the HTTP status and what OpenAI's error object says about it."""

    def __init__(self, status_code: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code


def error_body(err: APIError) -> dict:
    return {"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}}


def invalid(param: str | None, message: str) -> APIError:
    """A 400 that names the request field at fault, so a client knows what to fix."""
    return APIError(400, message, "invalid_request_error", param)


def field_error(exc: ValueError, names: dict[str, str] | None = None, prefix: str = "") -> APIError:
    """A 400 from an engine-side ``ValueError``, whose message starts with the engine's field name,
    renamed to the field the client sent (``names``: engine field -> request field)."""
    field, _, rest = str(exc).partition(" ")
    field = (names or {}).get(field, field)
    return invalid(prefix + field, f"{field} {rest}")
