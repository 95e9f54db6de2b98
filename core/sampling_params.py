"""Per-request sampling settings, shaped like vLLM's ``SamplingParams`` so callers can switch.

Every validation error is an ``InvalidRequest`` (a ``ValueError``) that names the field, so the
server can answer 400 naming it.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import InvalidRequest
from .families.kv_transport import KVPeer
from .structured.params import StructuredOutputsParams

GREEDY_TEMPERATURE = 1e-5  # below this, sampling is argmax (as vLLM treats it)
_MAX_PENALTY = 2.0  # OpenAI's range for presence and frequency penalties
_MAX_BIAS = 100.0  # OpenAI's range for logit_bias values


def _require(ok: bool, field: str, rule: str, value) -> None:
    if not ok:
        raise InvalidRequest(field, f"must {rule}, got {value!r}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 is greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    max_tokens: int | None = 16  # None: until the context is full
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n per generated token; 0: only the chosen token's
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    # prefill/decode disaggregation: the prefill engine and room of this request's KV (core/disagg/)
    kv_transfer: KVPeer | None = None
    structured_outputs: StructuredOutputsParams | None = None  # a grammar the output must match

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias is not None:
            self.logit_bias = self._normalized_bias(self.logit_bias)
        self._validate()

    @staticmethod
    def _normalized_bias(bias) -> dict[int, float]:
        """JSON clients send token ids as string keys; accept those, refuse anything else."""
        _require(isinstance(bias, dict), "logit_bias", "be a mapping of token id to bias", bias)
        out: dict[int, float] = {}
        for k, v in bias.items():
            try:
                tok = int(k)
            except (TypeError, ValueError):
                raise InvalidRequest("logit_bias", f"keys must be token ids, got {k!r}") from None
            _require(_is_number(v) and -_MAX_BIAS <= v <= _MAX_BIAS, "logit_bias",
                     f"have values in [-{_MAX_BIAS:g}, {_MAX_BIAS:g}]", v)
            out[tok] = float(v)
        return out

    def _validate(self) -> None:
        _require(_is_int(self.n) and self.n >= 1, "n", "be an integer >= 1", self.n)
        _require(_is_number(self.temperature) and self.temperature >= 0, "temperature", "be >= 0", self.temperature)
        _require(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", "be in (0, 1]", self.top_p)
        _require(_is_int(self.top_k) and self.top_k >= 0, "top_k", "be -1, 0 (off) or a positive integer", self.top_k)
        _require(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", "be in [0, 1]", self.min_p)
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            _require(_is_number(v) and -_MAX_PENALTY <= v <= _MAX_PENALTY, name,
                     f"be in [-{_MAX_PENALTY:g}, {_MAX_PENALTY:g}]", v)
        _require(_is_number(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty",
                 "be > 0", self.repetition_penalty)
        _require(self.seed is None or _is_int(self.seed), "seed", "be an integer or None", self.seed)
        for s in self.stop:
            _require(isinstance(s, str) and s != "", "stop", "hold non-empty strings", s)
        for t in self.stop_token_ids:
            _require(_is_int(t) and t >= 0, "stop_token_ids", "hold non-negative integers", t)
        _require(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1), "max_tokens",
                 "be an integer >= 1 or None", self.max_tokens)
        _require(_is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens", "be an integer >= 0",
                 self.min_tokens)
        if self.max_tokens is not None:
            _require(self.min_tokens <= self.max_tokens, "min_tokens",
                     f"be <= max_tokens ({self.max_tokens})", self.min_tokens)
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            _require(v is None or (_is_int(v) and v >= 0), name, "be an integer >= 0 or None", v)
        if self.structured_outputs is not None:
            _require(isinstance(self.structured_outputs, StructuredOutputsParams), "structured_outputs",
                     "be a StructuredOutputsParams", self.structured_outputs)
            # the grammar decides where the output ends: it allows EOS exactly where the output is complete
            _require(not self.ignore_eos, "ignore_eos", "be false with structured outputs", self.ignore_eos)
            _require(self.min_tokens == 0, "min_tokens", "be 0 with structured outputs", self.min_tokens)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def ending_ids(self, eos_token_ids: set[int]) -> frozenset[int]:
        """The ids that end a completion once ``min_tokens`` are out: the stop token ids, and EOS
        unless ``ignore_eos`` (the core ends it there, the detokenizer stops its text there)."""
        return frozenset(self.stop_token_ids).union(() if self.ignore_eos else eos_token_ids)

    def validate_against(self, vocab_size: int) -> None:
        """Checks that need the model: token ids must exist in its vocabulary."""
        bad = [t for t in self.stop_token_ids if t >= vocab_size]
        _require(not bad, "stop_token_ids", f"be in [0, {vocab_size})", bad)
        bad = [t for t in (self.logit_bias or {}) if not 0 <= t < vocab_size]
        _require(not bad, "logit_bias", f"have token ids in [0, {vocab_size})", bad)
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            _require(v is None or v <= vocab_size, name, f"be <= the vocabulary size {vocab_size}", v)
