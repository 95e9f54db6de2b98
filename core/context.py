"""The context rule, shared by the engine (at admission) and the API process (before sending)."""

from __future__ import annotations

from .errors import InvalidRequest


def check_context(prompt_len: int, max_tokens: int | None, max_model_len: int, min_tokens: int = 0) -> None:
    """Raise ``InvalidRequest`` naming the field. The context holds max_model_len positions of KV
    and the last sampled token needs none, so prompt + max_tokens may reach max_model_len + 1."""
    if prompt_len > max_model_len:
        raise InvalidRequest("prompt", f"has {prompt_len} tokens, more than the context length {max_model_len}")
    room = max_model_len - prompt_len + 1
    if max_tokens is not None and max_tokens > room:
        raise InvalidRequest("max_tokens", f"{max_tokens} exceeds the room left in the context: {room} for a "
                                           f"{prompt_len}-token prompt and context length {max_model_len}")
    if min_tokens > room:
        raise InvalidRequest("min_tokens", f"{min_tokens} exceeds the room left in the context: {room}")
