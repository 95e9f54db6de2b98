"""/v1/completions and /v1/chat/completions: requests in, engine runs, OpenAI bodies out.

A request with several prompts (or ``n`` > 1) becomes one engine request per prompt; choice
``index`` is ``prompt_index * n + completion_index`` as in vLLM. Streams merge the runs as their
tokens arrive. A client that goes away, streaming or not, cancels the runs, which aborts them in
the engine and frees their pages.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..core.context import check_context
from ..core.disagg.config import DisaggConfig
from ..core.errors import EngineError, InvalidRequest
from ..core.output_processor import Completion, Update
from ..core.sampling_params import SamplingParams
from ..core.structured.compiler import GrammarCompiler
from ..core.tokenizer import Tokenizer
from .bootstrap import kv_peers
from .chat_format import ChatRenderer
from .engine_client import EngineClient
from .errors import APIError, engine_error, error_body, invalid
from .generation import PromptRun
from .metrics import ServerMetrics
from .limits import Limits, check_logprob_entries, check_sequences
from .logprobs import TokenTexts, chat_logprobs, completion_logprobs, joined
from .chat_output import ChatOutputParser
from .chat_request import ChatPrompt, chat_prompt
from .protocol import (ChatChoice, ChatChoiceLogprobs, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
                       ChatCompletionResponse, ChatDelta, ChatResponseMessage, CompletionChoice, CompletionChunk,
                       CompletionRequest, CompletionResponse, DeltaToolCall, ResponseToolCall, Usage,
                       client_field_names, prompt_token_lists, to_sampling_params)
from .tool_parsers import ToolCallFormat


INLINE_TOKENIZE_CHARS = 1 << 14


@dataclass
class Serving:
    """What every generation route needs; built once when the engine is ready."""

    client: EngineClient
    tokenizer: Tokenizer
    chat_template: ChatRenderer
    metrics: ServerMetrics
    limits: Limits
    model_name: str
    max_model_len: int
    vocab_size: int
    grammars: GrammarCompiler  # compiles each request's grammar before it runs, to refuse a bad one with a 400
    disagg: DisaggConfig | None = None  # a prefill or decode server's (server/bootstrap.py)
    tool_format: ToolCallFormat | None = None  # how the model writes tool calls (--tool-call-parser)
    reasoning_parser: str | None = None  # whether the model writes <think> reasoning (--reasoning-parser)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                           "invalid_request_error", "model", "model_not_found")

    def new_run(self, ids: list[int], params: SamplingParams, text: str | None,
                names: dict[str, str] | None = None, prefix: str = "") -> PromptRun:
        """A run for one prompt, if it fits the context; a 400 names the field as ``names`` and
        ``prefix`` say the client spelled it."""
        try:
            check_context(len(ids), params.max_tokens, self.max_model_len, params.min_tokens)
        except InvalidRequest as e:
            raise engine_error(e, names, prefix) from None
        return PromptRun(self.tokenizer, ids, params, text)

    async def check_grammar(self, params: SamplingParams, prefix: str = "") -> None:
        """A 400 naming the field if the request's grammar does not compile within its time limit
        (in a worker thread; the engine compiles it again in its own process, off its loop)."""
        if params.structured_outputs is not None:
            try:
                await asyncio.to_thread(self.grammars.request(params.structured_outputs).wait)
            except InvalidRequest as e:
                raise engine_error(e, prefix=prefix) from None

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Tokenize; long texts in a worker thread, so one huge prompt does not stall every stream."""
        if len(text) < INLINE_TOKENIZE_CHARS:
            return self.tokenizer.encode(text, add_special_tokens)
        return await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens)

    async def encode_prompts(self, prompts: list[str] | list[list[int]]) -> list[list[int]]:
        """Token ids per prompt; many or long texts in one worker thread."""
        texts = [p for p in prompts if isinstance(p, str)]
        if sum(map(len, texts)) >= INLINE_TOKENIZE_CHARS:
            encoded = iter(await asyncio.to_thread(lambda: [self.tokenizer.encode(t) for t in texts]))
        else:
            encoded = iter([self.tokenizer.encode(t) for t in texts])
        return [next(encoded) if isinstance(p, str) else list(p) for p in prompts]

    def token_text(self, token_id: int) -> str:
        """A token's text; a piece of a multi-byte character has none, so it is named by id (as vLLM's
        ``token_id:N``), which also keeps top-logprob keys distinct."""
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return f"token_id:{token_id}" if "\ufffd" in text else text


# ---- running ----

async def _merged(runs: list[PromptRun], s: Serving, arrival: float) -> AsyncIterator[tuple[int, Update]]:
    """Updates of all runs as they come, tagged with the run's position."""
    if len(runs) == 1:
        async for u in runs[0].run(s.client, s.metrics, arrival):
            yield 0, u
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, run: PromptRun) -> None:
        try:
            async for u in run.run(s.client, s.metrics, arrival):
                queue.put_nowait((i, u))
        except BaseException as exc:
            queue.put_nowait(exc)
            raise
        finally:
            queue.put_nowait(done)

    tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(runs)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _run_to_end(runs: list[PromptRun], s: Serving, arrival: float, request: Request) -> bool:
    """Run every prompt to its end; False if the client went away first (then all are aborted)."""
    async def consume() -> None:
        async for _ in _merged(runs, s, arrival):
            pass

    work = asyncio.create_task(consume())
    gone = asyncio.create_task(_wait_disconnect(request))
    await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    if not work.done():
        work.cancel()
        await asyncio.gather(work, return_exceptions=True)
        return False
    gone.cancel()
    work.result()  # raises what the run raised
    return True


def _sse(payload: str) -> str:
    return f"data: {payload}\n\n"


def _stream(events: Callable[[], AsyncIterator[str]]) -> StreamingResponse:
    async def body() -> AsyncIterator[str]:
        try:
            async for chunk in events():
                yield _sse(chunk)
        except EngineError as exc:
            yield _sse(json.dumps(error_body(engine_error(exc))))
        yield _sse("[DONE]")

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _usage(runs: list[PromptRun], generated: bool = True) -> Usage:
    """``generated``: False where the drawn tokens are dropped (echo with max_tokens 0)."""
    prompt = sum(len(r.prompt_token_ids) for r in runs)
    completion = sum(len(c.token_ids) for r in runs for c in r.completions) if generated else 0
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _json_bytes(body: dict) -> bytes:
    return json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


async def _respond(runs: list[PromptRun], s: Serving, arrival: float, request: Request,
                   build: Callable[[], dict]) -> Response:
    """Run to the end, then build and serialise the answer in a worker thread: a large answer
    (many choices, logprobs) must not stall every other stream and /health while it is built."""
    try:
        if not await _run_to_end(runs, s, arrival, request):
            return Response(status_code=499)  # nobody is listening
    except EngineError as exc:
        err = engine_error(exc)
        return JSONResponse(error_body(err), status_code=err.status_code)
    return Response(await asyncio.to_thread(lambda: _json_bytes(build())), media_type="application/json")


# ---- /v1/completions ----

def _room(s: Serving, run: PromptRun) -> int:
    """The most tokens a run may generate."""
    return run.params.max_tokens or s.max_model_len - len(run.prompt_token_ids) + 1


async def create_completion(s: Serving, req: CompletionRequest, request: Request) -> Response:
    arrival = time.monotonic()
    s.check_model(req.model)
    params = to_sampling_params(req, s.limits, s.vocab_size)
    prompts = prompt_token_lists(req, s.vocab_size)
    check_sequences(len(prompts), params.n, s.limits)
    await s.check_grammar(params)
    peers = kv_peers(req, len(prompts), s.disagg)
    runs = []
    for p, ids, peer in zip(prompts, await s.encode_prompts(prompts), peers):
        if not ids:
            raise invalid("prompt", "prompt must not be empty")
        runs.append(s.new_run(ids, dataclasses.replace(params, kv_transfer=peer), p if isinstance(p, str) else None,
                              client_field_names(req)))
    n = params.n
    want_logprobs = req.logprobs is not None
    # the prompt scored, nothing generated (vLLM's echo with max_tokens 0): one token is drawn and dropped
    echo_only = req.echo and req.max_tokens == 0
    check_logprob_entries("logprobs", [len(r.prompt_token_ids) * req.echo + _room(s, r) for r in runs], n,
                          req.logprobs, s.limits)

    def echo_text(r: PromptRun) -> str:
        return r.prompt_text if r.prompt_text is not None else s.tokenizer.decode(r.prompt_token_ids)

    def logprobs_of(c: Completion, start: int, count: int, offset: int, texts: TokenTexts) -> dict | None:
        if not want_logprobs:
            return None
        return completion_logprobs(texts, c.token_ids[start:start + count], c.logprobs[start:start + count], offset)

    def prompt_logprobs(r: PromptRun, texts: TokenTexts) -> dict | None:
        """The echoed prompt's logprobs (once per prompt, shared by its choices)."""
        if not (req.echo and want_logprobs):
            return None
        return completion_logprobs(texts, r.prompt_token_ids, r.prompt_logprobs or [None] * len(r.prompt_token_ids), 0)

    def echoed(c: Completion, head: dict | None, tail: dict | None) -> tuple[dict | None, str | None]:
        """A choice's logprobs with its prompt's before them, and its finish_reason."""
        if echo_only:
            return head, "abort" if c.finish_reason == "abort" else "length"
        return (joined(head, tail) if head is not None else tail), c.finish_reason

    def answer() -> dict:
        texts, choices = TokenTexts(s.token_text), []
        for i, r in enumerate(runs):
            prompt = echo_text(r) if req.echo else ""
            head = prompt_logprobs(r, texts)
            for c in r.completions:
                lps, finish = echoed(c, head, logprobs_of(c, 0, len(c.token_ids), len(prompt), texts))
                choices.append({"index": i * n + c.index, "text": prompt + ("" if echo_only else c.text),
                                "logprobs": lps, "finish_reason": finish})
        return {**CompletionResponse(model=s.model_name, choices=[], usage=_usage(runs, not echo_only)).model_dump(),
                "choices": choices}

    if not req.stream:
        return await _respond(runs, s, arrival, request, answer)

    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    head = CompletionChunk(model=s.model_name, choices=[])

    def chunk(choices: list[CompletionChoice], usage: Usage | None = None) -> str:
        return CompletionChunk(id=head.id, created=head.created, model=s.model_name, choices=choices,
                               usage=usage).model_dump_json()

    async def events() -> AsyncIterator[str]:
        # as vLLM streams it: each choice's first chunk carries its echoed prompt and the prompt's
        # logprobs (they come with the first token), and text offsets count from the prompt's start
        echoes = await asyncio.to_thread(lambda: [echo_text(r) for r in runs]) if req.echo else [""] * len(runs)
        offsets: dict[tuple[int, int], int] = {}
        texts = TokenTexts(s.token_text)
        heads: dict[int, dict | None] = {}
        async for i, u in _merged(runs, s, arrival):
            c = u.completion
            key = (i, c.index)
            if echo_only and not u.finished:
                continue  # the drawn token is dropped; the prompt goes out once the run has ended
            first = key not in offsets
            off = offsets.get(key, len(echoes[i]))
            offsets[key] = off + len(u.text)
            text, lps, finish = u.text, logprobs_of(c, u.first_token, u.num_tokens, off, texts), c.finish_reason
            if first and req.echo:
                if i not in heads:
                    heads[i] = prompt_logprobs(runs[i], texts)
                lps, finish = echoed(c, heads[i], lps)
                text = echoes[i] + ("" if echo_only else text)
            yield chunk([CompletionChoice(index=i * n + c.index, text=text, logprobs=lps,
                                          finish_reason=finish if u.finished else None)])
        if include_usage:
            yield chunk([], _usage(runs, not echo_only))

    return _stream(events)


# ---- /v1/chat/completions ----

async def create_chat_completion(s: Serving, req: ChatCompletionRequest, request: Request) -> Response:
    arrival = time.monotonic()
    s.check_model(req.model)
    params = dataclasses.replace(to_sampling_params(req, s.limits, s.vocab_size),
                                 kv_transfer=kv_peers(req, 1, s.disagg)[0])
    prompt: ChatPrompt = await asyncio.to_thread(chat_prompt, req, s.chat_template, s.tool_format,
                                                 s.reasoning_parser)  # up to the template's deadline: not on the loop
    params = prompt.sampling_params(params, req)
    await s.check_grammar(params)
    ids = await s.encode(prompt.text, add_special_tokens=False)
    if not ids:
        raise invalid("messages", "the conversation renders to an empty prompt")
    run = s.new_run(ids, params, prompt.text, client_field_names(req))
    top = req.top_logprobs or 0
    check_logprob_entries(client_field_names(req).get("logprobs", "logprobs"), [_room(s, run)], params.n,
                          top if req.logprobs else None, s.limits)
    texts = TokenTexts(s.token_text)

    def logprobs_of(c: Completion, start: int, count: int) -> ChatChoiceLogprobs | None:
        if not req.logprobs:
            return None
        return chat_logprobs(texts, c.token_ids[start:start + count], c.logprobs[start:start + count], top)

    def finish_reason(c: Completion, parser: ChatOutputParser) -> str:
        return "tool_calls" if parser.num_calls and c.finish_reason == "stop" else c.finish_reason

    def message(c: Completion) -> tuple[ChatResponseMessage, str]:
        parser = prompt.output_parser()
        out = parser.feed(c.text, final=True)
        calls = [ResponseToolCall.of(call_id, call) for call_id, call in out.tool_calls()] or None
        content = None if calls and not out.content else out.content
        return (ChatResponseMessage(content=content, reasoning_content=out.reasoning or None, tool_calls=calls),
                finish_reason(c, parser))

    def answer() -> dict:
        choices = []
        for c in run.completions:
            msg, finish = message(c)
            choices.append(ChatChoice(index=c.index, message=msg, logprobs=logprobs_of(c, 0, len(c.token_ids)),
                                      finish_reason=finish))
        return ChatCompletionResponse(model=s.model_name, usage=_usage([run]), choices=choices).model_dump()

    if not req.stream:
        return await _respond([run], s, arrival, request, answer)

    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    head = ChatCompletionChunk(model=s.model_name, choices=[])
    parsers = {c.index: prompt.output_parser() for c in run.completions}
    so_far = {c.index: "" for c in run.completions}  # each completion's text, as its updates brought it

    def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
        return ChatCompletionChunk(id=head.id, created=head.created, model=s.model_name, choices=choices,
                                   usage=usage).model_dump_json()

    def deltas(parser: ChatOutputParser, text: str, final: bool) -> list[ChatDelta]:
        """The update's deltas: reasoning, then content, then the calls' pieces (a call's name, then its arguments)."""
        out = parser.feed(text, final)
        found = [ChatDelta(reasoning_content=out.reasoning)] if out.reasoning else []
        if out.content:
            found.append(ChatDelta(content=out.content))
        for d in out.calls:
            call = (DeltaToolCall.named(d.index, out.ids[d.index], d.name) if d.name is not None
                    else DeltaToolCall.arguments_of(d.index, d.arguments))
            found.append(ChatDelta(tool_calls=[call]))
        return found

    async def events() -> AsyncIterator[str]:
        for c in run.completions:
            yield chunk([ChatChunkChoice(index=c.index, delta=ChatDelta(role="assistant", content=""))])
        async for _, u in _merged([run], s, arrival):
            c = u.completion
            parser = parsers[c.index]
            so_far[c.index] += u.text
            found = deltas(parser, so_far[c.index], u.finished)
            lps = logprobs_of(c, u.first_token, u.num_tokens)
            if not found and (lps is not None or u.finished):
                found = [ChatDelta()]  # the tokens' logprobs, or the end, carry on an empty delta
            for k, d in enumerate(found):
                last = k == len(found) - 1
                yield chunk([ChatChunkChoice(index=c.index, delta=d, logprobs=lps if k == 0 else None,
                                             finish_reason=finish_reason(c, parser) if u.finished and last else None)])
        if include_usage:
            yield chunk([], _usage([run]))

    return _stream(events)
