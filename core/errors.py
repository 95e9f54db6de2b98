"""Errors that cross layers and processes as a code and a field, never as text to be parsed.

The engine raises them; the server maps each code to an HTTP status (server/errors.py), and the
engine process sends them over the wire as their parts (``code``, ``field``, ``detail``).
"""

from __future__ import annotations

import enum


class ErrorCode(str, enum.Enum):
    INVALID_REQUEST = "invalid_request"  # a field the caller can fix
    ENGINE_DEAD = "engine_dead"  # the engine loop or process is gone


class EngineError(Exception):
    """An error with a code, and the request field at fault where there is one."""

    code: ErrorCode

    def __init__(self, detail: str, field: str | None = None) -> None:
        self.field = field
        self.detail = detail
        super().__init__(self.message_for(field))

    def message_for(self, field: str | None) -> str:
        """The message, naming the field as ``field`` (the caller may spell it differently)."""
        return f"{field} {self.detail}" if field else self.detail


class InvalidRequest(EngineError, ValueError):
    """A request the engine cannot serve as given; ``field`` names what to fix."""

    code = ErrorCode.INVALID_REQUEST

    def __init__(self, field: str | None, detail: str) -> None:
        super().__init__(detail, field)


class EngineDeadError(EngineError, RuntimeError):
    """The engine is gone; no request can be served until it is back."""

    code = ErrorCode.ENGINE_DEAD

    def __init__(self, detail: str) -> None:
        super().__init__(detail)


def rebuild(code: str, detail: str, field: str | None) -> EngineError:
    """The error another process sent as its parts (an unknown code is refused)."""
    code = ErrorCode(code)
    if code is ErrorCode.INVALID_REQUEST:
        return InvalidRequest(field, detail)
    return EngineDeadError(detail)
