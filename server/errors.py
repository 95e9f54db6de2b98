"""Errors the HTTP API answers with, in the body shape OpenAI clients parse."""

from __future__ import annotations

from ..core.errors import EngineError, ErrorCode


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


# what each engine error code answers: HTTP status, OpenAI error type, OpenAI error code
_STATUS: dict[ErrorCode, tuple[int, str, str | None]] = {
    ErrorCode.INVALID_REQUEST: (400, "invalid_request_error", None),
    ErrorCode.ENGINE_DEAD: (500, "internal_server_error", "engine_dead"),
}


def engine_error(exc: EngineError, names: dict[str, str] | None = None, prefix: str = "") -> APIError:
    """The answer to an engine error, its field renamed to the one the client sent (``names``:
    engine field -> request field; ``prefix``: where the route nests it, as ``sampling_params.``)."""
    status, type_, code = _STATUS[exc.code]
    field = (names or {}).get(exc.field, exc.field) if exc.field is not None else None
    message = exc.message_for(field)
    if code == "engine_dead":
        message = f"the engine is not serving: {message}"
    return APIError(status, message, type_, prefix + field if field is not None else None, code)
