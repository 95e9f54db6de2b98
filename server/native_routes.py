"""``POST /generate``: the native route, token ids or text in, token ids and text out.

Shaped like SGLang's: ``{"text" | "input_ids", "sampling_params": {...}, "stream"}``, where
``sampling_params`` takes ``SamplingParams`` field names (``max_new_tokens`` as an alias of
``max_tokens``). Streaming sends one JSON object per update: the new text and ids.
"""

from __future__ import annotations

import json
import time
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import Response
from pydantic import ConfigDict

from ..core.errors import InvalidRequest
from ..core.sampling_params import SamplingParams
from ..core.structured.params import StructuredOutputsParams
from .errors import APIError, engine_error, invalid
from .generation import PromptRun
from .limits import Limits, check_range, check_stops, check_token_maps
from .openai_serving import Serving, _respond, _stream
from .protocol import Float32, Int64, RepetitionPenalty, StrictRequest, StructuredOutputs

PARAMS = "sampling_params."


class NativeSamplingParams(StrictRequest):
    """``SamplingParams``' fields, typed (strict, 64-bit integers, finite numbers); unknown ones refused."""

    model_config = ConfigDict(extra="forbid")

    n: Int64 | None = None
    temperature: Float32 | None = None
    top_p: Float32 | None = None
    top_k: Int64 | None = None
    min_p: Float32 | None = None
    presence_penalty: Float32 | None = None
    frequency_penalty: Float32 | None = None
    repetition_penalty: RepetitionPenalty | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int64] | None = None
    max_tokens: Int64 | None = None
    max_new_tokens: Int64 | None = None  # SGLang's name for max_tokens
    min_tokens: Int64 | None = None
    ignore_eos: bool | None = None
    logprobs: Int64 | None = None
    prompt_logprobs: Int64 | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    logit_bias: dict[str, Float32] | None = None
    structured_outputs: StructuredOutputs | None = None


class GenerateRequest(StrictRequest):
    text: str | None = None
    input_ids: list[Int64] | None = None
    sampling_params: NativeSamplingParams | None = None
    stream: bool = False


def _params(req: GenerateRequest, limits: Limits, vocab_size: int) -> tuple[SamplingParams, dict[str, str]]:
    """The engine's params and the names the client gave its fields (``max_new_tokens``)."""
    raw = req.sampling_params.model_dump(exclude_unset=True) if req.sampling_params else {}
    names = {}
    for name in ("logprobs", "prompt_logprobs"):  # computed by the engine, but not in this route's answer
        if raw.get(name) is not None:
            raise invalid(PARAMS + name, f"/generate does not return {name}; ask /v1/completions for them")
    if "max_new_tokens" in raw:
        if "max_tokens" in raw:
            raise invalid(PARAMS + "max_new_tokens", "give max_new_tokens or max_tokens, not both")
        raw["max_tokens"] = raw.pop("max_new_tokens")
        names["max_tokens"] = "max_new_tokens"
    try:
        check_range("n", raw.get("n"), 1, limits.max_n)
        check_stops(raw.get("stop"), limits)
        check_token_maps(raw.get("stop_token_ids"), raw.get("logit_bias"), limits)
    except APIError as e:
        e.param = PARAMS + e.param
        raise
    try:
        if req.sampling_params is not None and req.sampling_params.structured_outputs is not None:
            raw["structured_outputs"] = StructuredOutputsParams(**req.sampling_params.structured_outputs.kinds())
        params = SamplingParams(**raw)
        params.validate_against(vocab_size)
    except InvalidRequest as e:
        raise engine_error(e, names, PARAMS) from None
    return params, names


async def _prompt(req: GenerateRequest, s: Serving) -> tuple[list[int], str | None]:
    text, ids = req.text, req.input_ids
    if (text is None) == (ids is None):
        raise invalid("text", "give exactly one of text and input_ids")
    if text is not None:
        if not text:
            raise invalid("text", "text must be a non-empty string")
        return await s.encode(text), text
    if not ids:
        raise invalid("input_ids", "input_ids must be a non-empty list of token ids")
    bad = [t for t in ids if not 0 <= t < s.vocab_size]
    if bad:
        raise invalid("input_ids", f"input_ids must be in [0, {s.vocab_size}); got {bad[:5]}")
    return ids, None


def _meta(run: PromptRun, c) -> dict:
    return {"finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
            "prompt_tokens": len(run.prompt_token_ids), "completion_tokens": len(c.token_ids),
            "cached_tokens": run.num_cached_tokens}


async def generate(s: Serving, req: GenerateRequest, request: Request) -> Response:
    arrival = time.monotonic()
    params, names = _params(req, s.limits, s.vocab_size)
    await s.check_grammar(params, PARAMS)
    ids, text = await _prompt(req, s)
    run = s.new_run(ids, params, text, names, PARAMS)

    def result():
        outs = [{"text": c.text, "output_ids": c.token_ids, "meta_info": _meta(run, c)} for c in run.completions]
        return outs[0] if len(outs) == 1 else outs

    if not req.stream:
        return await _respond([run], s, arrival, request, result)

    async def events() -> AsyncIterator[str]:
        async for u in run.run(s.client, s.metrics, arrival):
            c = u.completion
            yield json.dumps({"index": c.index, "text": u.text,
                              "output_ids": c.token_ids[u.first_token:u.first_token + u.num_tokens],
                              "meta_info": _meta(run, c) if u.finished else None})

    return _stream(events)
