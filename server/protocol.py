"""OpenAI-compatible request and response bodies, and their translation into ``SamplingParams``.

Requests validate types strictly (``"3"`` is not a number) and refuse fields they do not know, so
a request never runs without something it asked for: the fields OpenAI's API has and this server
does not do are declared and refused with the reason, the rest as unknown. Every integer fits 64 bits (the engine's wire format is msgpack) and
every number is finite. Every refusal is an ``APIError`` 400 naming the field at fault, the field
as the client spelled it (``max_completion_tokens``, not the engine's ``max_tokens``).
Response models use OpenAI's field names exactly, so the official client parses them.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..core.errors import InvalidRequest
from ..core.sampling_params import SamplingParams
from ..core.structured.params import StructuredOutputsParams
from .errors import APIError, engine_error, invalid
from .unsupported import CHAT_UNSUPPORTED, refuse_unsupported
from .limits import Limits, check_range, check_stops, check_token_maps


# ---- requests ----

Int64 = Annotated[int, Field(ge=-2**63, le=2**63 - 1)]
# The engine samples in float32: a number past its range (1e300) becomes inf there, and NaN logits.
F32_MAX = 3.4028234663852886e38
Float32 = Annotated[float, Field(ge=-F32_MAX, le=F32_MAX)]
# logits are divided by it: much smaller overflows float32 and makes NaN logits too
RepetitionPenalty = Annotated[float, Field(ge=1e-6, le=F32_MAX)]


class StrictRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class StreamOptions(StrictRequest):
    include_usage: bool = False


class JsonSchemaFormat(StrictRequest):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, populate_by_name=True)

    name: str
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None  # schemas compile in strict mode either way (no properties beyond those named)


class ResponseFormat(StrictRequest):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(StrictRequest):
    """vLLM's ``structured_outputs`` extra field: exactly one of these."""

    json_: dict[str, Any] | bool | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, populate_by_name=True)

    def kinds(self) -> dict[str, Any]:
        """The kinds set, as ``StructuredOutputsParams`` takes them (which refuses none or several)."""
        kinds = {"json": self.json_, "json_object": self.json_object, "regex": self.regex, "choice": self.choice,
                 "grammar": self.grammar}
        return {k: v for k, v in kinds.items() if v is not None and v is not False}


class _SamplingRequest(StrictRequest):
    """Fields both endpoints share; None means the engine's default."""

    model: str | None = None
    n: Int64 | None = None
    temperature: Float32 | None = None
    top_p: Float32 | None = None
    top_k: Int64 | None = None
    min_p: Float32 | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int64] | None = None
    seed: Int64 | None = None
    presence_penalty: Float32 | None = None
    frequency_penalty: Float32 | None = None
    repetition_penalty: RepetitionPenalty | None = None
    ignore_eos: bool | None = None
    min_tokens: Int64 | None = None
    logit_bias: dict[str, Float32] | None = None
    skip_special_tokens: bool | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # prefill/decode disaggregation: what the gateway adds (server/bootstrap.py checks them)
    bootstrap_host: Annotated[str, Field(max_length=255)] | list[Annotated[str, Field(max_length=255)]] | None = None
    bootstrap_port: Int64 | list[Int64] | None = None
    bootstrap_room: Int64 | list[Int64] | None = None
    # structured outputs: OpenAI's response_format, and vLLM's extra fields; at most one of them
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[Int64] | list[list[Int64]]
    max_tokens: Int64 | None = 16
    logprobs: Int64 | None = None
    echo: bool = False
    # Declared only to refuse what this server does not do, rather than ignore it.
    suffix: str | None = None
    best_of: Int64 | None = None

    @field_validator("suffix")
    @classmethod
    def _refuse_suffix(cls, v):
        if v:
            raise ValueError("suffix (insertion) is not supported by this server")
        return v

    @field_validator("best_of")
    @classmethod
    def _refuse_best_of(cls, v, info):
        if v is not None and v != (info.data.get("n") or 1):
            raise ValueError("best_of other than n is not supported by this server")
        return v


class TextPart(StrictRequest):
    type: Literal["text"]
    text: str


class ChatMessage(StrictRequest):
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart]
    name: str | None = None

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int64 | None = None
    max_completion_tokens: Int64 | None = None
    logprobs: bool = False
    top_logprobs: Int64 | None = None
    # Declared only to refuse them: templates run server-side code and are the operator's choice.
    chat_template: Any = None
    chat_template_kwargs: Any = None
    # Declared only to refuse what this server does not do, rather than ignore it.
    tools: Any = None
    functions: Any = None
    tool_choice: Any = None
    function_call: Any = None
    # OpenAI's fields that this server does not do (server/unsupported.py), refused with the reason
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    web_search_options: Any = None
    store: Any = None
    metadata: Any = None
    service_tier: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    moderation: Any = None
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None
    # identifiers for the caller's own use; they change nothing here (the prefix cache is automatic)
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    parallel_tool_calls: bool | None = None  # means nothing without tools

    @field_validator(*CHAT_UNSUPPORTED)
    @classmethod
    def _refuse_unsupported(cls, v, info):
        return refuse_unsupported(CHAT_UNSUPPORTED, info.field_name, v)

    @field_validator("chat_template", "chat_template_kwargs")
    @classmethod
    def _refuse_client_templates(cls, v, info):
        if v is not None:
            raise ValueError(f"{info.field_name} may not be set by the request")
        return v

    @field_validator("tools", "functions")
    @classmethod
    def _refuse_tools(cls, v, info):
        if v:
            raise ValueError(f"{info.field_name} (tool calling) are not supported by this server")
        return v

    @field_validator("tool_choice", "function_call")
    @classmethod
    def _no_tool_choice(cls, v, info):
        if v not in (None, "none", "auto"):
            raise ValueError(f"{info.field_name} must be none or auto: tool calling is not supported")
        return v


# ---- requests -> engine inputs ----

_SHARED_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "seed",
                  "presence_penalty", "frequency_penalty", "repetition_penalty", "ignore_eos", "min_tokens",
                  "logit_bias", "skip_special_tokens")


def _length_and_logprobs(req: CompletionRequest | ChatCompletionRequest) -> dict[str, tuple[Any, str]]:
    """The engine fields whose names or meaning differ between the two endpoints: their values, and
    the request field each came from."""
    if isinstance(req, CompletionRequest):
        return {"max_tokens": (req.max_tokens, "max_tokens"), "logprobs": (req.logprobs, "logprobs"),
                "prompt_logprobs": (req.logprobs if req.echo else None, "logprobs")}
    if req.top_logprobs is not None and not req.logprobs:
        raise invalid("top_logprobs", "top_logprobs needs logprobs set to true")
    if req.max_completion_tokens is not None:
        max_tokens = (req.max_completion_tokens, "max_completion_tokens")
    else:
        max_tokens = (req.max_tokens, "max_tokens")
    top = "top_logprobs" if req.top_logprobs is not None else "logprobs"
    return {"max_tokens": max_tokens, "logprobs": ((req.top_logprobs or 0) if req.logprobs else None, top)}


def structured_outputs_of(req: CompletionRequest | ChatCompletionRequest) -> StructuredOutputsParams | None:
    """The grammar a request asks for, from whichever field it came, that field its ``source``; a 400
    where it sets several, or sets one badly."""
    asked: list[tuple[str, dict]] = []  # (the field, StructuredOutputsParams' arguments)
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        asked.append(("response_format", {"json_object": True, "source": "response_format"}))
    elif rf is not None and rf.type == "json_schema":
        field = "response_format.json_schema.schema"
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise invalid(field, "a json_schema response format needs its schema")
        asked.append((field, {"json": rf.json_schema.schema_, "source": field}))
    if req.structured_outputs is not None:
        asked.append(("structured_outputs", req.structured_outputs.kinds()))
    for kind in ("json", "regex", "choice", "grammar"):
        if (value := getattr(req, f"guided_{kind}")) is not None:
            asked.append((f"guided_{kind}", {kind: value, "source": f"guided_{kind}"}))
    if len(asked) > 1:
        raise invalid(asked[1][0], f"{asked[0][0]} and {asked[1][0]} both constrain the output: set one")
    try:
        return StructuredOutputsParams(**asked[0][1]) if asked else None
    except InvalidRequest as e:
        raise engine_error(e) from None


def client_field_names(req: CompletionRequest | ChatCompletionRequest) -> dict[str, str]:
    """Engine field -> the request field it came from, where they differ."""
    return {name: param for name, (_, param) in _length_and_logprobs(req).items() if name != param}


def to_sampling_params(req: CompletionRequest | ChatCompletionRequest, limits: Limits,
                       vocab_size: int) -> SamplingParams:
    """Enforce the server's limits, then let ``SamplingParams`` judge the rest; 400s name the field."""
    check_range("n", req.n, 1, limits.max_n)
    check_stops(req.stop, limits)
    check_token_maps(req.stop_token_ids, req.logit_bias, limits)
    special = _length_and_logprobs(req)
    for name, (value, param) in special.items():
        if name == "max_tokens":
            if value is not None and value < 1:
                raise invalid(param, f"{param} must be >= 1, got {value}")
        else:
            check_range(param, value, 0, limits.max_logprobs)
    kwargs = {f: getattr(req, f) for f in _SHARED_FIELDS if getattr(req, f) is not None}
    kwargs.update({name: value for name, (value, _) in special.items()})
    kwargs["structured_outputs"] = structured_outputs_of(req)
    try:
        params = SamplingParams(**kwargs)
        params.validate_against(vocab_size)
    except InvalidRequest as e:
        raise engine_error(e, client_field_names(req)) from None
    return params


def prompt_token_lists(req: CompletionRequest, vocab_size: int) -> list[list[int]] | list[str]:
    """One entry per prompt (text, or token ids checked against the vocabulary)."""
    p = req.prompt
    prompts = [p] if isinstance(p, str) or (p and all(isinstance(t, int) for t in p)) else list(p)
    if not prompts:
        raise invalid("prompt", "prompt must not be empty")
    for item in prompts:
        if len(item) == 0:
            raise invalid("prompt", "prompt must not be empty (nor hold an empty prompt)")
        if isinstance(item, list):
            if min(item) < 0:
                raise invalid("prompt", f"prompt token ids must be >= 0, got {min(item)}")
            if max(item) >= vocab_size:
                raise invalid("prompt", f"prompt token id {max(item)} is out of vocabulary "
                                        f"(vocabulary size {vocab_size})")
    return prompts


# Pydantic labels a union member's error with the member's type ("str", "list[int]", "TextPart");
# those are not fields, so the param leaves them out.
_TYPE_LABELS = {"str", "int", "float", "bool", "list", "dict", "none", "constrained-int", "constrained-str"}


def _is_type_label(x: str) -> bool:
    return x in _TYPE_LABELS or "[" in x or x[:1].isupper()


def pydantic_error_to_api(exc: pydantic.ValidationError) -> APIError:
    """A 400 naming the first failing field by its dotted location (``messages.0.content``)."""
    first = exc.errors()[0]
    parts = [str(x) for x in first["loc"] if isinstance(x, int) or not _is_type_label(x)]
    param = ".".join(parts) or None
    msg = "unknown field: this server does not support it" if first["type"] == "extra_forbidden" else first["msg"]
    return invalid(param, f"{param}: {msg}" if param else msg)


# ---- responses ----

FinishReason = Literal["stop", "length", "abort"]


def _now() -> int:
    return int(time.time())


def _id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None  # None only in a stream, before the last chunk


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: _id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class CompletionChunk(CompletionResponse):
    """OpenAI streams completions as partial ``text_completion`` objects."""


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: FinishReason


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: _id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    id: str = Field(default_factory=lambda: _id("chatcmpl"))
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None  # only on the final chunk, when stream_options.include_usage
