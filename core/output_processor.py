"""From the core's typed outputs to what a reader sees: token ids, text, logprobs, endings.

The core ends a completion by token (EOS, stop token ids, lengths). Stop strings need text, so they
are decided here, where the text is made, and nowhere else: a completion that reaches one ends
here, and its reader ends it in the core too (``Update.stop_string``). ``LLMEngine`` reads its own
core through this; the API process reads the engine process's through it (server/generation.py),
so the server's text equals the library's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from .detokenizer import IncrementalDetokenizer
from .outputs import CompletionDelta, CompletionOutput, EngineCoreOutput, RequestOutput
from .sampling_params import SamplingParams
from .tokenizer import Tokenizer


@dataclass
class Completion:
    """One of a request's ``n`` completions: tokens, text and logprobs so far."""

    index: int
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def text(self) -> str:
        """All text handed out so far (the detokenizer keeps it)."""
        return self.detok.output_text

    def apply(self, d: CompletionDelta) -> Update | None:
        """Take a delta of this completion; what it changed (None: nothing, or it had ended). After a
        stop string the rest of the delta is not taken."""
        if self.finish_reason is not None:  # ended already (here, on a stop string): nothing more to take
            return None
        detok, text, used = self.detok, "", 0
        for tok in d.token_ids:
            text += detok.add(tok)
            used += 1
            if detok.finished_by_stop is not None:
                self.finish_reason, self.stop_reason = "stop", detok.finished_by_stop
                break
        else:
            if d.finish_reason is not None:
                text += detok.flush()
                self.finish_reason, self.stop_reason = d.finish_reason, d.stop_reason
                if detok.finished_by_stop is not None:  # text held back until the end held a stop string
                    self.finish_reason, self.stop_reason = "stop", detok.finished_by_stop
        start = len(self.token_ids)
        if used:
            self.token_ids += d.token_ids[:used] if used < len(d.token_ids) else d.token_ids
            if self.logprobs is not None and d.logprobs is not None:
                self.logprobs += d.logprobs[:used]
        done = self.finish_reason is not None
        if not (used or done or text):
            return None
        return Update(self, text, start, used, done, done and d.finish_reason is None)

    def output(self) -> CompletionOutput:
        return CompletionOutput(self.index, self.text, list(self.token_ids),
                                list(self.logprobs) if self.logprobs is not None else None,
                                self.finish_reason, self.stop_reason)


class Update(msgspec.Struct):
    """What one core output changed for one completion (a Struct: one is made per completion per
    step, and its constructor runs in C)."""

    completion: Completion
    text: str
    first_token: int  # index into completion.token_ids of the first token this update added
    num_tokens: int
    finished: bool
    stop_string: bool  # it ended here on a stop string, and the core has yet to hear


class RequestState:
    """One core request as its reader follows it: a prompt and its ``n`` completions."""

    def __init__(self, request_id: str, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams,
                 prompt_text: str | None = None) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.prompt_text = prompt_text
        self.params = params
        self.completions = [
            Completion(i, IncrementalDetokenizer(tokenizer, prompt_token_ids, params),
                       logprobs=[] if params.logprobs is not None else None)
            for i in range(params.n)
        ]
        self.prompt_logprobs: list[dict[int, float] | None] | None = None
        self.num_cached_tokens = 0

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.completions)

    def apply(self, out: EngineCoreOutput) -> list[Update]:
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.num_cached_tokens = out.num_cached_tokens
        completions = self.completions
        return [u for d in out.completions if (u := completions[d.index].apply(d)) is not None]

    def output(self) -> RequestOutput:
        """The cumulative state so far (what ``LLM.generate`` returns once finished)."""
        return RequestOutput(self.request_id, self.prompt_text, list(self.prompt_token_ids),
                             [c.output() for c in self.completions],
                             list(self.prompt_logprobs) if self.prompt_logprobs is not None else None,
                             self.finished, self.num_cached_tokens)


StopString = tuple[str, int, str]  # request id, completion index, the stop string


class OutputProcessor:
    """Every request an in-process engine serves, read into ``RequestOutput``s."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, tuple[RequestState, bool]] = {}  # with whether it streams

    def add(self, request_id: str, prompt_text: str | None, prompt_token_ids: list[int], params: SamplingParams,
            stream: bool) -> None:
        """With ``stream`` every output that changes it is returned; else only its end."""
        self._states[request_id] = (RequestState(request_id, self.tokenizer, prompt_token_ids, params, prompt_text),
                                    stream)

    def process(self, outs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[StopString]]:
        """The outputs of the requests these changed, and the stop strings the core must hear of."""
        results, stops = [], []
        for out in outs:
            entry = self._states.get(out.request_id)
            if entry is None:  # ended here already (stop strings); the core caught up
                continue
            state, stream = entry
            ended = False  # an unfinished state only finishes by an update that ends a completion
            for u in state.apply(out):
                if u.finished:
                    ended = True
                    if u.stop_string:
                        stops.append((out.request_id, u.completion.index, u.completion.stop_reason))
            if ended and state.finished:
                del self._states[out.request_id]
                results.append(state.output())
            elif stream:
                results.append(state.output())
        return results, stops
