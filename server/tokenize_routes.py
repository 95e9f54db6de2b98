"""/tokenize and /detokenize, shaped like vLLM's (lm-eval's remote tokenizer and scoring tools ask
for them): a prompt, or chat messages rendered by the served template, to token ids and back."""

from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field, model_validator

from .errors import invalid
from .openai_serving import Serving
from .protocol import ChatMessage, Int64, StrictRequest

INLINE_DECODE_TOKENS = 1 << 14  # longer lists are decoded in a worker thread


class TokenizeRequest(StrictRequest):
    """vLLM's two shapes in one: ``prompt``, or ``messages`` (with ``add_generation_prompt``)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (the template adds them)
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self


class DetokenizeRequest(StrictRequest):
    model: str | None = None
    tokens: list[Int64]


async def tokenize(s: Serving, req: TokenizeRequest, _: Request) -> Response:
    s.check_model(req.model)
    if req.prompt is not None:
        ids = await s.encode(req.prompt, True if req.add_special_tokens is None else req.add_special_tokens)
    else:
        messages = [{"role": m.role, "content": m.text} for m in req.messages]
        text = await asyncio.to_thread(s.chat_template.render, messages, req.add_generation_prompt)
        ids = await s.encode(text, bool(req.add_special_tokens))
    strs = s.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
    return JSONResponse({"count": len(ids), "max_model_len": s.max_model_len, "tokens": ids, "token_strs": strs})


async def detokenize(s: Serving, req: DetokenizeRequest, _: Request) -> Response:
    s.check_model(req.model)
    bad = next((t for t in req.tokens if not 0 <= t < s.vocab_size), None)
    if bad is not None:
        raise invalid("tokens", f"token id {bad} is outside the vocabulary [0, {s.vocab_size})")
    if len(req.tokens) < INLINE_DECODE_TOKENS:
        text = s.tokenizer.decode(req.tokens, skip_special_tokens=False)
    else:
        text = await asyncio.to_thread(s.tokenizer.decode, req.tokens, False)
    return JSONResponse({"prompt": text})
