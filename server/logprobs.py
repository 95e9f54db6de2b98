"""Logprobs in OpenAI's two shapes: the completions' parallel lists and the chat's per-token objects.

An answer names each token by its text, and a token id recurs across positions, alternatives and
choices, so ``TokenTexts`` decodes each id once per answer. Echoed prompt logprobs are built once
per prompt and shared (by reference) by all of its choices.
"""

from __future__ import annotations

from typing import Callable

from .protocol import ChatChoiceLogprobs, ChatTokenLogprob, TopLogprob


class TokenTexts(dict):
    """Token id -> its text in answers, decoded on first use."""

    def __init__(self, token_text: Callable[[int], str]) -> None:
        super().__init__()
        self._token_text = token_text

    def __missing__(self, token_id: int) -> str:
        text = self[token_id] = self._token_text(token_id)
        return text


def completion_logprobs(texts: TokenTexts, token_ids: list[int], logprobs: list[dict[int, float] | None],
                        offset: int) -> dict:
    """``CompletionLogprobs`` as a plain dict (lists that several choices may share)."""
    tokens, offsets, chosen, tops = [], [], [], []
    for tid, lp in zip(token_ids, logprobs):
        text = texts[tid]
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        chosen.append(lp[tid] if lp is not None else None)
        tops.append({texts[t]: v for t, v in lp.items()} if lp is not None else None)
    return {"text_offset": offsets, "token_logprobs": chosen, "tokens": tokens, "top_logprobs": tops}


def joined(head: dict, tail: dict) -> dict:
    """An echoed prompt's logprobs followed by a completion's; the entries themselves are shared."""
    return {k: head[k] + tail[k] for k in head}


def chat_logprobs(texts: TokenTexts, token_ids: list[int], logprobs: list[dict[int, float]],
                  top: int) -> ChatChoiceLogprobs:
    content = []
    for tid, lp in zip(token_ids, logprobs):
        text = texts[tid]
        best = sorted(lp.items(), key=lambda kv: -kv[1])[:top]
        content.append(ChatTokenLogprob(
            token=text, logprob=lp[tid], bytes=list(text.encode()),
            top_logprobs=[TopLogprob(token=(t := texts[k]), logprob=v, bytes=list(t.encode())) for k, v in best]))
    return ChatChoiceLogprobs(content=content)
