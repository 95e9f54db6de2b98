"""Speculative decoding's configuration, shaped like vLLM's ``speculative_config``.

Checked when the engine config is made, so a bad one fails at start-up naming the field. Which
methods exist is the spec family's to say: a method is the name of a registered proposer
(``engine plugins`` lists them), checked when the engine is built (core/startup.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any, Mapping

MAX_SPECULATIVE_TOKENS = 16  # drafts a sequence may bring to one step
NGRAM_DEFAULT_LOOKUP = 5  # vLLM's prompt_lookup_min and _max when neither is given


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class SpecConfigError(ValueError):
    """A speculative config the engine cannot run; the message names the field."""

    def __init__(self, field: str | None, detail: str) -> None:
        self.field = f"speculative_config.{field}" if field else "speculative_config"
        super().__init__(f"{self.field}: {detail}")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str  # a registered proposer: "ngram"
    num_speculative_tokens: int  # K: drafts per sequence per step
    prompt_lookup_min: int | None = None  # n-gram: the shortest suffix looked up
    prompt_lookup_max: int | None = None  # n-gram: the longest
    model: str | None = None  # a drafter's checkpoint (draft model, DSpark)

    def __post_init__(self) -> None:
        if not isinstance(self.method, str) or not self.method:
            raise SpecConfigError("method", f"must name a proposer, got {self.method!r}")
        k = self.num_speculative_tokens
        if not _is_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise SpecConfigError("num_speculative_tokens", f"must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], "
                                                            f"got {k!r}")
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or v < 1):
                raise SpecConfigError(name, f"must be an integer >= 1, got {v!r}")
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise SpecConfigError("model", f"must be a checkpoint directory, got {self.model!r}")
        if self.method == "ngram":  # vLLM's defaults: one bound gives the other, neither gives 5
            lo = self.prompt_lookup_min or self.prompt_lookup_max or NGRAM_DEFAULT_LOOKUP
            hi = self.prompt_lookup_max or self.prompt_lookup_min or NGRAM_DEFAULT_LOOKUP
            object.__setattr__(self, "prompt_lookup_min", lo)
            object.__setattr__(self, "prompt_lookup_max", hi)
        if (self.prompt_lookup_min is not None and self.prompt_lookup_max is not None
                and self.prompt_lookup_min > self.prompt_lookup_max):
            raise SpecConfigError("prompt_lookup_min", f"must be <= prompt_lookup_max ({self.prompt_lookup_max}), "
                                                       f"got {self.prompt_lookup_min}")

    @classmethod
    def of(cls, value: SpeculativeConfig | Mapping[str, Any] | str) -> SpeculativeConfig:
        """From a mapping (``LLM(speculative_config={...})``, the engine process's JSON) or a JSON
        object (``--speculative-config``)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise SpecConfigError(None, f"not JSON: {exc}") from None
        if not isinstance(value, Mapping):
            raise SpecConfigError(None, f"must be an object of method, num_speculative_tokens, ...; got {value!r}")
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise SpecConfigError(unknown[0], f"unknown key; known: {', '.join(known)}")
        for required in ("method", "num_speculative_tokens"):
            if required not in value:
                raise SpecConfigError(required, "is required")
        return cls(**value)
