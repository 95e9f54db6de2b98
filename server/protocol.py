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
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

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


RESERVED_TEMPLATE_NAMES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})


class _FieldError(ValueError):
    """A model-level check's refusal that names its field (pydantic_error_to_api reads it)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


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
    structural_tag: dict[str, Any] | str | None = None

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, populate_by_name=True)

    def kinds(self) -> dict[str, Any]:
        """The kinds set, as ``StructuredOutputsParams`` takes them (which refuses none or several)."""
        kinds = {"json": self.json_, "json_object": self.json_object, "regex": self.regex, "choice": self.choice,
                 "grammar": self.grammar, "structural_tag": self.structural_tag}
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


class CalledFunction(StrictRequest):
    name: str
    arguments: str


class AssistantToolCall(StrictRequest):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(StrictRequest):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = None  # an assistant's calls, in the history
    tool_call_id: str | None = None  # a tool message answers this call
    reasoning_content: str | None = None  # an assistant's reasoning, which some templates render
    # what the client's own message objects carry back when there is nothing in them
    refusal: None = None
    function_call: None = None
    audio: None = None

    @model_validator(mode="after")
    def _fits_its_role(self):
        if self.tool_calls and self.role != "assistant":
            raise _FieldError("tool_calls", "tool_calls belong to assistant messages")
        if self.role == "tool" and not self.tool_call_id:
            raise _FieldError("tool_call_id", "a tool message needs the tool_call_id it answers")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise _FieldError("content", "content is required (null only on an assistant message with tool_calls)")
        return self

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


# OpenAI's rule for function names
FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:\-]{1,64}$")]


class FunctionDefinition(StrictRequest):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema (checked against its metaschema)
    strict: bool | None = None  # arguments are held to the schema either way where tool_choice forces calls


class Tool(StrictRequest):
    type: Literal["function"]
    function: FunctionDefinition


class ChosenFunction(StrictRequest):
    name: str


class NamedToolChoice(StrictRequest):
    type: Literal["function"]
    function: ChosenFunction


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int64 | None = None
    max_completion_tokens: Int64 | None = None
    logprobs: bool = False
    top_logprobs: Int64 | None = None
    # Declared only to refuse it: templates run server-side code and are the operator's choice.
    chat_template: Any = None
    # values for the operator's template (enable_thinking, thinking, ...); JSON values only
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # the deprecated forms of tools and tool_choice, refused with the names to use
    functions: Any = None
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

    @field_validator(*CHAT_UNSUPPORTED)
    @classmethod
    def _refuse_unsupported(cls, v, info):
        return refuse_unsupported(CHAT_UNSUPPORTED, info.field_name, v)

    @field_validator("chat_template")
    @classmethod
    def _refuse_client_templates(cls, v, info):
        if v is not None:
            raise ValueError(f"{info.field_name} may not be set by the request")
        return v

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_values(cls, v):
        for key in v or {}:
            if not key.isidentifier() or key in RESERVED_TEMPLATE_NAMES:
                raise ValueError(f"{key!r} may not be set: the server sets {', '.join(sorted(RESERVED_TEMPLATE_NAMES))}"
                                 if key in RESERVED_TEMPLATE_NAMES else f"{key!r} is not a template variable name")
        return v

    @field_validator("functions", "function_call")
    @classmethod
    def _refuse_legacy_functions(cls, v, info):
        if v is not None:
            instead = "tools" if info.field_name == "functions" else "tool_choice"
            raise ValueError(f"{info.field_name} is OpenAI's deprecated form: send {instead} instead")
        return v

    @model_validator(mode="after")
    def _tool_choice_fits_tools(self):
        choice = self.tool_choice
        if choice in ("required",) or isinstance(choice, NamedToolChoice):
            if not self.tools:
                raise _FieldError("tool_choice", "tool_choice forces a tool call, but no tools were given")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in {t.function.name for t in self.tools}:
            raise _FieldError("tool_choice.function.name",
                               f"no tool is called {choice.function.name!r} in tools")
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            raise _FieldError("tools", "two tools have the same name")
        return self


# ---- requests -> engine inputs ----

_SHARED_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "seed",
                  "presence_penalty", "frequency_penalty", "repetition_penalty", "ignore_eos", "min_tokens",
                  "logit_bias", "skip_special_tokens")


def _length_and_logprobs(req: CompletionRequest | ChatCompletionRequest) -> dict[str, tuple[Any, str]]:
    """The engine fields whose names or meaning differ between the two endpoints: their values, and
    the request field each came from."""
    if isinstance(req, CompletionRequest):
        # echo with max_tokens 0 scores the prompt: one token is drawn and dropped (openai_serving.py)
        max_tokens = 1 if req.echo and req.max_tokens == 0 else req.max_tokens
        return {"max_tokens": (max_tokens, "max_tokens"), "logprobs": (req.logprobs, "logprobs"),
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
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, _FieldError):  # a check of the whole request that names its field
        param, msg = ".".join([*parts, cause.field]), str(cause)
    return invalid(param, f"{param}: {msg}" if param else msg)


# ---- responses ----

FinishReason = Literal["stop", "length", "abort"]
ChatFinishReason = Literal["stop", "length", "abort", "tool_calls"]


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


class ResponseFunction(BaseModel):
    name: str
    arguments: str  # JSON text


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunction

    @classmethod
    def of(cls, call_id: str, call) -> "ResponseToolCall":
        return cls(id=call_id, function=ResponseFunction(name=call.name, arguments=call.arguments))


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ResponseToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: ChatFinishReason


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: _id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class DeltaFunction(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """OpenAI streams a call as its index, id, type and name first, then its arguments in pieces."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunction

    @classmethod
    def named(cls, index: int, call_id: str, name: str) -> "DeltaToolCall":
        return cls(index=index, id=call_id, type="function", function=DeltaFunction(name=name, arguments=""))

    @classmethod
    def arguments_of(cls, index: int, arguments: str) -> "DeltaToolCall":
        return cls(index=index, function=DeltaFunction(arguments=arguments))


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: ChatFinishReason | None = None


class ChatCompletionChunk(BaseModel):
    id: str = Field(default_factory=lambda: _id("chatcmpl"))
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None  # only on the final chunk, when stream_options.include_usage
