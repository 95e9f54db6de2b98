"""OpenAI request fields this server does not do: each is declared and refused by name with the
reason (a 400 naming it), never ignored. The values a client sends when it asks for nothing of it
(``store: false``, ``modalities: ["text"]``) pass. Fields the server knows nothing of at all are
refused as unknown by the request models (``extra="forbid"``)."""

from __future__ import annotations

from typing import Any

# field -> (the values that ask for nothing, why anything else is refused)
CHAT_UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "audio": ((None,), "audio output is not supported: this server writes text"),
    "modalities": ((None, ["text"]), 'only ["text"] is supported: this server writes text'),
    "prediction": ((None,), "predicted outputs are not supported"),
    "web_search_options": ((None,), "web search is not supported"),
    "store": ((None, False), "stored completions are not supported"),
    "metadata": ((None, {}), "metadata belongs to stored completions, which are not supported"),
    "service_tier": ((None, "auto", "default"), "service tiers are not supported"),
    "reasoning_effort": ((None,), "reasoning effort is not supported"),
    "verbosity": ((None,), "verbosity is not supported"),
    "moderation": ((None,), "moderation is not supported"),
    "prompt_cache_retention": ((None,), "prompt cache retention is not supported: the prefix cache is automatic"),
    "prompt_cache_options": ((None,), "prompt cache options are not supported: the prefix cache is automatic"),
}


def refuse_unsupported(table: dict[str, tuple[tuple[Any, ...], str]], field: str, value: Any) -> Any:
    """``value`` if it asks for nothing of ``field``; else a ValueError saying why (pydantic makes
    it a 400 naming the field)."""
    allowed, why = table[field]
    if not any(value == a and type(value) is type(a) for a in allowed):
        raise ValueError(f"{why}; this server accepts only {', '.join(map(repr, allowed))} here")
    return value
