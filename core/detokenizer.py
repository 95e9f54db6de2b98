"""Incremental detokenization with stop strings: turns one sequence's tokens into final text.

Text is decoded over a short window of ids (``prefix_offset`` to the end) and only the part past
the window's already-emitted prefix is new. A window whose text ends in U+FFFD is waiting for the
rest of a multi-byte character, so nothing is emitted until it completes (the technique of vLLM
and of HF's DecodeStream). The window starts in the prompt, so decoders that drop a leading space
on the first token see the context the model saw.

Stop strings: text that could still become a stop string is held back, so no delta ever contains
one, even split across tokens. Stop strings only end a sequence once more than ``min_tokens``
tokens are out (as in vLLM). A token that ends the sequence by id (a stop token id, or EOS unless
``ignore_eos``) adds no text unless ``include_stop_str_in_output``, also as in vLLM.
"""

from __future__ import annotations

from .sampling_params import SamplingParams
from .tokenizer import Tokenizer

PROMPT_CONTEXT = 5  # prompt tokens the decode window starts with


def _common_prefix_len(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self._ids = list(prompt_token_ids[-PROMPT_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._num_output = 0
        self._text = ""  # decoded so far, after any stop-string cut
        self._emitted = 0  # length of the prefix of _text handed out
        self._check_from = 0  # a stop string must end past here (text before min_tokens never stops)
        self._done = False
        self.finished_by_stop: str | None = None

    @property
    def output_text(self) -> str:
        """All text emitted so far: the concatenation of every delta."""
        return self._text[:self._emitted]

    def add(self, token_id: int) -> str:
        """Take the next generated token; return the text that became final with it."""
        if self._done:
            return ""
        self._num_output += 1
        p = self.params
        ends = self._num_output >= p.min_tokens and (
            token_id in p.stop_token_ids or (not p.ignore_eos and token_id in self.tokenizer.eos_token_ids))
        if not ends or p.include_stop_str_in_output:
            self._ids.append(token_id)
        self._done = ends
        return self._release(self._decode_new(final=ends), final=ends)

    def flush(self) -> str:
        """The sequence ended for another reason: hand out whatever was held back."""
        if self._done:
            return ""
        self._done = True
        return self._release(self._decode_new(final=True), final=True)

    def _decode_new(self, final: bool) -> str:
        skip = self.params.skip_special_tokens
        prefix = self.tokenizer.decode(self._ids[self._prefix_offset:self._read_offset], skip_special_tokens=skip)
        text = self.tokenizer.decode(self._ids[self._prefix_offset:], skip_special_tokens=skip)
        # text extends prefix, except where the prompt ended inside a character this token completes
        n = len(prefix) if text.startswith(prefix) else _common_prefix_len(prefix, text)
        if len(text) <= n or (text.endswith("\ufffd") and not final):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return text[n:]

    def _release(self, piece: str, final: bool) -> str:
        self._text += piece
        stops = self.params.stop
        hold = 0
        if stops and not self.finished_by_stop:
            if self._num_output > self.params.min_tokens:
                self._cut_at_stop()
            else:
                self._check_from = len(self._text)
            if not (final or self.finished_by_stop):
                hold = self._held_back()
        end = len(self._text) - hold
        delta = self._text[self._emitted:end]
        self._emitted = end
        return delta

    def _cut_at_stop(self) -> None:
        """Truncate at the earliest stop string in the unemitted text, if one is there."""
        best: tuple[int, int, str] | None = None
        for s in self.params.stop:
            i = self._text.find(s, max(self._emitted, self._check_from - len(s) + 1))
            if i >= 0 and (best is None or (i, i + len(s)) < best[:2]):
                best = (i, i + len(s), s)
        if best is None:
            return
        start, end, s = best
        self._text = self._text[:end if self.params.include_stop_str_in_output else start]
        self.finished_by_stop = s
        self._done = True

    def _held_back(self) -> int:
        """Length of the longest unemitted suffix that is the start of some stop string."""
        room = len(self._text) - self._emitted
        hold = 0
        for s in self.params.stop:
            for k in range(min(len(s) - 1, room), hold, -1):
                if self._text.endswith(s[:k]):
                    hold = k
                    break
        return hold
