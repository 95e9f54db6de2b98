"""Incremental detokenization with stop strings: turns one sequence's tokens into final text.

Text is decoded over a short window of ids (``prefix_offset`` to the end) and only the part past
the window's already-emitted prefix is new. A window whose text ends in U+FFFD is waiting for the
rest of a multi-byte character, so nothing is emitted until it completes (the technique of vLLM
and of HF's DecodeStream). The window starts in the prompt, so decoders that drop a leading space
on the first token see the context the model saw.

Bytes that never make a character (a model repeating a lone continuation byte) would keep that
wait going forever, the window, and the cost of decoding it, growing with every token. A
character has at most ``MAX_CHAR_BYTES`` bytes, so once more tokens than that wait, everything
but the last few is settled: its text is emitted where the whole window's text agrees with it,
and the window moves past it. The window stays bounded; the text is the same.

Stop strings: text that could still become a stop string is held back, so no delta ever contains
one, even split across tokens. Stop strings only end a sequence once more than ``min_tokens``
tokens are out (as in vLLM). A token that ends the sequence by id (a stop token id, or EOS unless
``ignore_eos``) adds no text unless ``include_stop_str_in_output``, also as in vLLM.

Work per token is bounded by the window and the longest stop string, never by the text so far:
the emitted deltas are kept as a list and joined only when ``output_text`` is read.
"""

from __future__ import annotations

from .sampling_params import SamplingParams
from .tokenizer import Tokenizer

PROMPT_CONTEXT = 5  # prompt tokens the decode window starts with
MAX_CHAR_BYTES = 4  # the longest UTF-8 character


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
        self._skip = params.skip_special_tokens
        self._ending_ids = params.ending_ids(tokenizer.eos_token_ids)
        self._ids = list(prompt_token_ids[-PROMPT_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text: str | None = None  # the text of ids[prefix_offset:read_offset], once decoded
        self._num_output = 0
        self._emitted: list[str] = []  # every delta handed out
        self._tail = ""  # decoded but not handed out: it may be the start of a stop string
        self._check_from = 0  # in _tail: a stop string must end past here (text before min_tokens never stops)
        self._done = False
        self.finished_by_stop: str | None = None

    @property
    def output_text(self) -> str:
        """All text emitted so far: the concatenation of every delta."""
        parts = self._emitted
        if len(parts) > 1:
            parts[:] = ["".join(parts)]
        return parts[0] if parts else ""

    def add(self, token_id: int) -> str:
        """Take the next generated token; return the text that became final with it."""
        if self._done:
            return ""
        self._num_output += 1
        ends = token_id in self._ending_ids and self._num_output >= self.params.min_tokens
        if not ends or self.params.include_stop_str_in_output:
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
        ids, skip, decode = self._ids, self._skip, self.tokenizer.decode
        prefix = self._prefix_text
        if prefix is None:
            prefix = self._prefix_text = decode(ids[self._prefix_offset:self._read_offset], skip_special_tokens=skip)
        text = decode(ids[self._prefix_offset:], skip_special_tokens=skip)
        # text extends prefix, except where the prompt ended inside a character this token completes
        n = len(prefix) if text.startswith(prefix) else _common_prefix_len(prefix, text)
        if text.endswith("\ufffd") and not final:
            return self._settled(text, n)
        if len(text) <= n:
            return ""
        # emitted up to the end: the window starts where this new text did
        self._prefix_offset, self._read_offset, self._prefix_text = self._read_offset, len(ids), None
        return text[n:]

    def _settled(self, text: str, n: int) -> str:
        """The new text of a window that ends in U+FFFD and cannot be waiting for a character any
        more: that of all but the last tokens that might still hold a character's first bytes
        (``MAX_CHAR_BYTES`` - 1 of them, special tokens that decode to nothing not counted), where
        the whole window's text agrees with it; "" while fewer tokens wait."""
        ids = self._ids
        if len(ids) - self._read_offset <= MAX_CHAR_BYTES:
            return ""
        skipped = set(self.tokenizer.all_special_ids) if self._skip else set()
        cut, kept = len(ids), 0
        while kept < MAX_CHAR_BYTES - 1 and cut > self._read_offset:
            cut -= 1
            kept += ids[cut] not in skipped
        if cut <= self._read_offset:
            return ""
        settled = self.tokenizer.decode(ids[self._prefix_offset:cut], skip_special_tokens=self._skip)
        if len(settled) <= n or not text.startswith(settled):
            return ""
        self._prefix_offset, self._read_offset, self._prefix_text = self._read_offset, cut, None
        return settled[n:]

    def _release(self, piece: str, final: bool) -> str:
        if not self.params.stop:
            if piece:
                self._emitted.append(piece)
            return piece
        if not (piece or final):  # nothing new: no stop string ends here, nothing more can be released
            return ""
        tail = self._tail + piece
        if self._num_output > self.params.min_tokens:
            tail = self._cut_at_stop(tail)
        else:
            self._check_from = len(tail)
        end = len(tail) if final or self._done else len(tail) - self._held_back(tail)
        delta, self._tail = tail[:end], tail[end:]
        self._check_from = max(0, self._check_from - end)
        if delta:
            self._emitted.append(delta)
        return delta

    def _cut_at_stop(self, tail: str) -> str:
        """``tail`` truncated at its earliest stop string, if one is there (which ends the sequence)."""
        best: tuple[int, int, str] | None = None
        for s in self.params.stop:
            i = tail.find(s, max(0, self._check_from - len(s) + 1))
            if i >= 0 and (best is None or (i, i + len(s)) < best[:2]):
                best = (i, i + len(s), s)
        if best is None:
            return tail
        start, end, s = best
        self.finished_by_stop = s
        self._done = True
        return tail[:end if self.params.include_stop_str_in_output else start]

    def _held_back(self, tail: str) -> int:
        """Length of the longest suffix of ``tail`` that is the start of some stop string."""
        hold = 0
        for s in self.params.stop:
            for k in range(min(len(s) - 1, len(tail)), hold, -1):
                if tail.endswith(s[:k]):
                    hold = k
                    break
        return hold
