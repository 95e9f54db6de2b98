"""From the core's typed outputs to what a reader sees: token ids, text, logprobs, endings.

The core ends a completion by token (EOS, stop token ids, lengths). Stop strings need text, so they
are decided here, where the text is made, and nowhere else: a completion that reaches one ends
here, and its reader ends it in the core too (``Update.stop_string``). ``LLMEngine`` reads its own
core through this; the API process reads the engine process's through it (server/generation.py),
so the server's text equals the library's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def apply(self, d: CompletionDelta) -> tuple[str, int]:
        """Take a delta; return the new text and how many tokens it consumed (after a stop string, none)."""
        if self.finish_reason is not None:
            return "", 0
        pieces, used = [], 0
        for i, tok in enumerate(d.token_ids):
            self.token_ids.append(tok)
            if self.logprobs is not None and d.logprobs is not None:
                self.logprobs.append(d.logprobs[i])
            pieces.append(self.detok.add(tok))
            used += 1
            if self.detok.finished_by_stop is not None:
                self.finish_reason, self.stop_reason = "stop", self.detok.finished_by_stop
                break
        else:
            if d.finish_reason is not None:
                pieces.append(self.detok.flush())
                self.finish_reason, self.stop_reason = d.finish_reason, d.stop_reason
                if self.detok.finished_by_stop is not None:  # text held back until the end held a stop string
                    self.finish_reason, self.stop_reason = "stop", self.detok.finished_by_stop
        new = "".join(pieces)
        self.text += new
        return new, used

    def output(self) -> CompletionOutput:
        return CompletionOutput(self.index, self.text, list(self.token_ids),
                                list(self.logprobs) if self.logprobs is not None else None,
                                self.finish_reason, self.stop_reason)


@dataclass
class Update:
    """What one core output changed for one completion."""

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
        updates = []
        for d in out.completions:
            c = self.completions[d.index]
            was_done = c.finish_reason is not None
            start = len(c.token_ids)
            text, used = c.apply(d)
            done = c.finish_reason is not None and not was_done
            if used or done or text:
                updates.append(Update(c, text, start, used, done, done and d.finish_reason is None))
        return updates

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
            if out.request_id not in self._states:  # ended here already (stop strings); the core caught up
                continue
            state, stream = self._states[out.request_id]
            stops += [(out.request_id, u.completion.index, u.completion.stop_reason)
                      for u in state.apply(out) if u.stop_string]
            if state.finished:
                del self._states[out.request_id]
                results.append(state.output())
            elif stream:
                results.append(state.output())
        return results, stops
