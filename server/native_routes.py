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

from ..core.sampling_params import SamplingParams
from .errors import APIError, invalid
from .generation import PromptRun
from .openai_serving import Serving, _respond, _stream
from .protocol import Limits, check_range, check_stops


def _params(raw, limits: Limits, vocab_size: int) -> SamplingParams:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise invalid("sampling_params", "sampling_params must be an object")
    raw = dict(raw)
    if "max_new_tokens" in raw:
        raw["max_tokens"] = raw.pop("max_new_tokens")
    known = SamplingParams.__dataclass_fields__
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise invalid(f"sampling_params.{unknown[0]}", f"sampling_params has no field {unknown[0]!r}")
    try:
        params = SamplingParams(**raw)
        params.validate_against(vocab_size)
    except ValueError as e:
        field = str(e).split(" ", 1)[0]
        raise invalid(f"sampling_params.{field}", str(e)) from None
    try:
        check_range("n", params.n, 1, limits.max_n)
        for name in ("logprobs", "prompt_logprobs"):
            check_range(name, getattr(params, name), 0, limits.max_logprobs)
        check_stops(params.stop, limits)
    except APIError as e:
        e.param = f"sampling_params.{e.param}"
        raise
    return params


async def _prompt(body: dict, s: Serving) -> tuple[list[int], str | None]:
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise invalid("text", "give exactly one of text and input_ids")
    if text is not None:
        if not isinstance(text, str) or not text:
            raise invalid("text", "text must be a non-empty string")
        return await s.encode(text), text
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise invalid("input_ids", "input_ids must be a non-empty list of token ids")
    bad = [t for t in ids if not 0 <= t < s.vocab_size]
    if bad:
        raise invalid("input_ids", f"input_ids must be in [0, {s.vocab_size}); got {bad[:5]}")
    return ids, None


def _meta(run: PromptRun, c) -> dict:
    return {"finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
            "prompt_tokens": len(run.prompt_token_ids), "completion_tokens": len(c.token_ids),
            "cached_tokens": run.num_cached_tokens}


async def generate(s: Serving, body: dict, request: Request) -> Response:
    arrival = time.monotonic()
    params = _params(body.get("sampling_params"), s.limits, s.vocab_size)
    ids, text = await _prompt(body, s)
    run = s.new_run(ids, params, text)

    def result():
        outs = [{"text": c.text, "output_ids": c.token_ids, "meta_info": _meta(run, c)} for c in run.completions]
        return outs[0] if len(outs) == 1 else outs

    if not body.get("stream"):
        return await _respond([run], s, arrival, request, result)

    async def events() -> AsyncIterator[str]:
        async for u in run.run(s.client, s.metrics, arrival):
            c = u.completion
            yield json.dumps({"index": c.index, "text": u.text,
                              "output_ids": c.token_ids[u.first_token:u.first_token + u.num_tokens],
                              "meta_info": _meta(run, c) if u.finished else None})

    return _stream(events)
