"""Per-request ceilings: what one request may ask of the server, refused with a 400 naming the field.

Each bound caps work that a small body could otherwise multiply: ``n`` and the prompt list
(engine sequences), logprobs (a dict per token), stop strings (scanned after every token), stop
token ids and logit_bias entries (applied at every step), and the logprob entries an answer carries. Echoed prompt logprobs are the sharpest multiplier: a
4,000-token prompt echoed into 16 choices with 20 alternatives each is 1.3 M entries from a
few KiB of request, so they count per choice they are echoed into.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import invalid


@dataclass(frozen=True)
class Limits:
    max_n: int = 16
    max_logprobs: int = 20
    max_stop_sequences: int = 16
    max_stop_length: int = 1024
    max_stop_token_ids: int = 1024
    max_logit_bias: int = 1024  # entries; every step applies them to every row that has them
    max_seqs_per_request: int = 64  # prompts x n: engine sequences one request may start
    max_logprob_entries: int = 2**20  # logprob values one answer may carry: tokens x choices x (logprobs + 1)


def check_range(param: str, value: int | None, low: int, high: int) -> None:
    if value is not None and not low <= value <= high:
        raise invalid(param, f"{param} must be in [{low}, {high}], got {value}")


def check_stops(stop: str | list[str] | None, limits: Limits) -> None:
    stops = [stop] if isinstance(stop, str) else stop or []
    if len(stops) > limits.max_stop_sequences:
        raise invalid("stop", f"stop may hold at most {limits.max_stop_sequences} sequences, got {len(stops)}")
    for s in stops:
        if len(s) > limits.max_stop_length:
            raise invalid("stop", f"stop sequences may be at most {limits.max_stop_length} characters, "
                                  f"got {len(s)}")


def check_token_maps(stop_token_ids: list[int] | None, logit_bias: dict | None, limits: Limits) -> None:
    for param, value, cap in (("stop_token_ids", stop_token_ids, limits.max_stop_token_ids),
                              ("logit_bias", logit_bias, limits.max_logit_bias)):
        if value is not None and len(value) > cap:
            raise invalid(param, f"{param} may hold at most {cap} entries, got {len(value)}")


def check_sequences(num_prompts: int, n: int, limits: Limits) -> None:
    """Prompts x n, so a prompt list cannot carry a request past what ``n`` alone may ask."""
    if num_prompts * n > limits.max_seqs_per_request:
        param = "prompt" if num_prompts > 1 else "n"
        raise invalid(param, f"{num_prompts} prompts x n {n} = {num_prompts * n} sequences; a request may start "
                             f"at most {limits.max_seqs_per_request}")


def check_logprob_entries(param: str, tokens_per_choice: list[int], n: int, logprobs: int | None,
                          limits: Limits) -> None:
    """The logprob values an answer would carry: per prompt, its tokens with logprobs (echoed prompt
    plus at most max_tokens generated) in each of its ``n`` choices, each with ``logprobs`` + 1 values."""
    if logprobs is None:
        return
    entries = sum(tokens_per_choice) * n * (logprobs + 1)
    if entries > limits.max_logprob_entries:
        raise invalid(param, f"{param} {logprobs} over {sum(tokens_per_choice)} tokens x n {n} would return "
                             f"{entries} logprob values; an answer may carry at most {limits.max_logprob_entries} "
                             "(ask for fewer logprobs, choices, tokens or prompts)")
