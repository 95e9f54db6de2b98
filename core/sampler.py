"""Batched token sampling over one step's fp32 logits, in vLLM's order of processing.

Logit bias, min_tokens masking, repetition penalty, then frequency and presence penalties; greedy
rows take the argmax of that, the others go through temperature, top-k, top-p and min-p before a
draw, both on the sampling family's backend (core/families/sampling.py). Reported logprobs are those of the raw model logits (vLLM's default), so they say what the
model thought, not what the sampling settings made of it.

Nothing waits for the device: the draws are written into the token table (core/token_table.py),
where the next step reads its inputs, and come to the host behind the step, read when the engine
processes it. So a row's last token may still be in flight when it is sampled again; it is in the
table at the row's slot, and the penalties and the min_tokens count take it from there.

Rows with a grammar (structured outputs) have every token it forbids set to -inf first, before
anything else reads the logits (core/structured/bitmask.py), so their draws, greedy or sampled,
and their logprobs are those of the allowed tokens; the other rows of the batch are untouched.

A batch of plain greedy rows (nothing that changes the logits, no logprobs: the common decode)
takes a fast path: one argmax. Otherwise nothing a batch does not need runs either: no copy of the
logits where nothing changes them in place, no logprobs where no row asks for them.

A draw is ``argmax(probs / q)`` with ``q ~ Exp(1)`` per token, which picks token ``i`` with
probability ``probs[i]``. A seeded row takes its ``q`` from its own generator only, so its tokens
do not depend on what else is in the batch; unseeded rows share the sampler's generator.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any, Protocol

import torch

from .families.sampling import SamplingBackend
from .host_copy import HostCopy
from .native.sampling import NativeSampling
from .sampling_params import SamplingParams
from .structured.bitmask import mask_logits
from .to_device import to_device
from .token_table import TokenTable


class SamplingRow(Protocol):
    """What sampling reads of a row's sequence. The engine passes its ``Sequence``s (core/sequence.py)
    as they are, so a step builds nothing per row."""

    params: SamplingParams
    generator: torch.Generator | None  # None: the sampler's shared generator
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # those on the host
    slot: int  # its token table slot, where the draw goes; 0: scratch
    grammar: Any  # its grammar matcher (structured outputs), at the state after its host tokens; None: free

    @property
    def in_flight(self) -> bool:
        """One more output token, not on the host yet: in the table at ``slot``."""

    @property
    def num_output(self) -> int:
        """Its output tokens, the one in flight counted."""


class SamplerOutput:
    """A step's draws: on the device at once, on the host when first read (core/host_copy.py), so
    reading waits for the step."""

    def __init__(self, token_ids: torch.Tensor, chosen: torch.Tensor | None = None,
                 top: tuple[torch.Tensor, torch.Tensor] | None = None, top_n: list[int | None] | None = None) -> None:
        """``chosen``: the raw logprob of each draw; ``top``: (logprobs, ids) of the rows whose ``top_n`` > 0
        (in row order), ``top_n`` each row's params.logprobs."""
        self.device_token_ids = token_ids
        self.constrained = False  # some row drew under a grammar
        self._top_n = top_n
        self._host = HostCopy([t for t in (token_ids, chosen, *(top or ())) if t is not None])

    def wait(self) -> None:
        self._host.wait()

    @cached_property
    def token_ids(self) -> list[int]:
        self.wait()
        return self._host.tolist(0)

    @cached_property
    def logprobs(self) -> list[float] | None:
        """The raw logprob of each chosen token; None where no row asks for logprobs."""
        return self._host.tolist(1) if self._top_n is not None else None

    @cached_property
    def top_logprobs(self) -> list[list[tuple[int, float]] | None]:
        """Top-n (id, logprob) where params.logprobs is set."""
        if self._top_n is None:
            return [None] * len(self.token_ids)
        out: list[list[tuple[int, float]] | None] = [None if n is None else [] for n in self._top_n]
        if len(self._host) == 4:
            rows = (i for i, n in enumerate(self._top_n) if n)
            for i, v, t in zip(rows, self._host.tolist(2), self._host.tolist(3)):
                n = self._top_n[i]
                out[i] = list(zip(t[:n], v[:n]))
        return out


class PromptLogprobs:
    """A prompt chunk's logprobs: computed on the device at once, on the host when first read
    (core/host_copy.py), so the step that computes them waits for nothing."""

    def __init__(self, logits: torch.Tensor, next_token_ids: list[int], top_n: int) -> None:
        """``logits``: one row per position, predicting ``next_token_ids``; ``top_n`` more tokens each."""
        if logits.shape[0] != len(next_token_ids):
            raise ValueError(f"{logits.shape[0]} rows of logits for {len(next_token_ids)} next tokens")
        lp = torch.log_softmax(logits.float(), dim=-1)
        chosen = lp.gather(1, to_device(next_token_ids, torch.int64, lp.device)[:, None]).squeeze(1)
        top = lp.topk(min(top_n, lp.shape[1]), dim=-1) if top_n > 0 else ()
        self._next = next_token_ids
        self._host = HostCopy([chosen, *top])

    @cached_property
    def entries(self) -> list[dict[int, float]]:
        """Per position, the logprob of the token that follows, then those of the top_n tokens."""
        out = [{t: c} for t, c in zip(self._next, self._host.tolist(0))]
        if len(self._host) == 3:
            for d, v, t in zip(out, self._host.tolist(1), self._host.tolist(2)):
                d.update(zip(t, v))
        return out


def _ragged_index(pairs: list[tuple[int, list[int]]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column index tensors for per-row token lists of different lengths."""
    rows = [i for i, toks in pairs for _ in toks]
    cols = [t for _, toks in pairs for t in toks]
    return to_device(rows, torch.int64, device), to_device(cols, torch.int64, device)


class Sampler:
    def __init__(self, vocab_size: int, eos_token_ids: set[int], table: TokenTable,
                 backend: SamplingBackend | None = None, seed: int | None = None) -> None:
        """``backend``: what filters and draws (the native oracle where none is given)."""
        self.vocab_size = vocab_size
        self.backend = backend or NativeSampling(None)
        self.eos_token_ids = sorted(eos_token_ids)
        self.table = table
        self.device = table.device
        self.generator = torch.Generator(device=self.device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """The draws of ``rows``, written into their table slots; nothing here waits for the device."""
        if logits.dim() != 2 or logits.shape[0] != len(rows) or logits.shape[1] != self.vocab_size:
            raise ValueError(f"logits must be [{len(rows)}, {self.vocab_size}], got {list(logits.shape)}")
        constrained = [i for i, r in enumerate(rows) if r.grammar is not None]
        if constrained:
            logits = mask_logits(logits, constrained, [rows[i].grammar for i in constrained])
        out = SamplerOutput(logits.argmax(dim=-1)) if all(map(self._plain_greedy, rows)) else self.sample(logits, rows)
        out.constrained = bool(constrained)
        self.table.write([r.slot for r in rows], out.device_token_ids)
        return out

    @staticmethod
    def _plain_greedy(row: SamplingRow) -> bool:
        """Greedy, no logprobs, and none of what ``process`` applies: the raw logits' argmax."""
        p = row.params
        return (p.greedy and p.logprobs is None and not p.logit_bias and p.repetition_penalty == 1.0
                and p.frequency_penalty == 0 and p.presence_penalty == 0
                and (not p.min_tokens or row.num_output >= p.min_tokens))

    def sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """The general path, whatever the rows ask for."""
        logits = logits.float()
        x = self.process(logits, rows)
        sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
        if len(sampled) == len(rows):
            tokens = self._draw(x, rows)
        else:
            tokens = x.argmax(dim=-1)
            if sampled:
                idx = to_device(sampled, torch.int64, x.device)
                tokens[idx] = self._draw(x.index_select(0, idx), [rows[i] for i in sampled])
        return self.output(logits, tokens, rows)

    @staticmethod
    def output(logits: torch.Tensor, tokens: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """The draws ``tokens`` of ``rows`` with the raw logprobs the rows ask for."""
        top_n = [r.params.logprobs for r in rows]
        if all(n is None for n in top_n):
            return SamplerOutput(tokens)
        raw = torch.log_softmax(logits, dim=-1)
        chosen = raw.gather(1, tokens[:, None]).squeeze(1)
        wanted = [i for i, n in enumerate(top_n) if n]
        top = None
        if wanted:
            most = min(max(top_n[i] for i in wanted), raw.shape[1])
            top = raw.index_select(0, to_device(wanted, torch.int64, raw.device)).topk(most, dim=-1)
        return SamplerOutput(tokens, chosen, top, top_n)

    def process(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """The logits after bias, min_tokens masking and penalties: greedy rows take their argmax.
        A row's token still in flight counts (read from the token table)."""
        dev = logits.device
        bias = [(i, r.params.logit_bias) for i, r in enumerate(rows) if r.params.logit_bias]
        early = [(i, self.eos_token_ids + r.params.stop_token_ids) for i, r in enumerate(rows)
                 if r.num_output < r.params.min_tokens]
        x = logits.clone() if bias or early else logits  # the two in-place steps; the others make new tensors
        if bias:
            ri, ci = _ragged_index([(i, list(b)) for i, b in bias], dev)
            x.index_put_((ri, ci), to_device([v for _, b in bias for v in b.values()], x.dtype, dev), accumulate=True)
        if early:
            x.index_put_(_ragged_index(early, dev), torch.full((), float("-inf"), device=dev))
        rep = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
        if rep:
            seen, true = torch.zeros_like(x, dtype=torch.bool), torch.ones((), dtype=torch.bool, device=dev)
            seen.index_put_(_ragged_index([(i, rows[i].prompt_token_ids + rows[i].output_token_ids) for i in rep], dev),
                            true)
            flight = self._in_flight(rows, rep)
            if flight is not None:
                seen.index_put_(flight, true)
            pen = to_device([r.params.repetition_penalty for r in rows], x.dtype, dev)[:, None]
            x = torch.where(seen, torch.where(x > 0, x / pen, x * pen), x)
        counted = [i for i, r in enumerate(rows) if r.params.frequency_penalty != 0 or r.params.presence_penalty != 0]
        if counted:
            ri, ci = _ragged_index([(i, rows[i].output_token_ids) for i in counted], dev)
            counts = torch.zeros_like(x).index_put_((ri, ci), torch.ones_like(ci, dtype=x.dtype), accumulate=True)
            flight = self._in_flight(rows, counted)
            if flight is not None:
                counts.index_put_(flight, torch.ones(len(flight[0]), dtype=x.dtype, device=dev), accumulate=True)
            freq = to_device([r.params.frequency_penalty for r in rows], x.dtype, dev)[:, None]
            pres = to_device([r.params.presence_penalty for r in rows], x.dtype, dev)[:, None]
            x = x - freq * counts - pres * (counts > 0)
        return x

    def _in_flight(self, rows: list[SamplingRow], which: list[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(row, token) index tensors of the tokens in flight of the rows ``which``, the tokens from the table."""
        flying = [i for i in which if rows[i].in_flight]
        if not flying:
            return None
        return to_device(flying, torch.int64, self.device), self.table.read([rows[i].slot for i in flying])

    def _draw(self, x: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        params = [r.params for r in rows]
        return self.backend.draw(x, self.noise(x, rows), [p.temperature for p in params], [p.top_k for p in params],
                                 [p.top_p for p in params], [p.min_p for p in params])

    def noise(self, x: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Exp(1) per token: a seeded row's from its own generator, the others' from the shared one."""
        q = torch.empty_like(x)
        shared = [j for j, r in enumerate(rows) if r.generator is None]
        if len(shared) == len(rows):  # the same draws as the scatter below, without it
            q.exponential_(generator=self.generator)
        elif shared:
            noise = torch.empty((len(shared), x.shape[1]), device=x.device).exponential_(generator=self.generator)
            q[to_device(shared, torch.int64, x.device)] = noise
        for j, r in enumerate(rows):
            if r.generator is not None:
                q[j].exponential_(generator=r.generator)
        return q
