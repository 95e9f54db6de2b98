"""The load-aware verify length (DSpark's load-aware prefix scheduler): per request, how many of its
drafts the target verifies, from the proposer's confidence in each and a throughput curve of the
verify step measured at start-up.

A draft ``k`` of request ``i`` adds ``Π_{j<=k} c_ij`` expected tokens (it is kept only if those
before it are) and one token to the step. A step of ``B`` decodes verifying ``N`` drafts in all
yields ``B + Σ`` (the chosen prefix products) tokens in ``T(B + N)`` seconds, ``T`` the curve. For
a given ``N`` the best drafts are the ``N`` largest prefix products (a request's never increase,
so they form each request's first drafts); ``N`` is then the one with the most tokens per second,
0 included. Where the step is memory-bound (``T`` flat) drafts are nearly free and all but the
hopeless are verified; where it is compute-bound (``T`` proportional to its tokens: high load) a
draft costs what a request's own token costs and pays less, so none is, and the step is what it
would be without speculation. Drafting itself costs time as well (measured as it runs, per batch
size): a step whose expected best does not beat no speculation even with typical confidences does
not draft at all.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepCurve:
    """Seconds of a target step by the tokens it computes: linear between measured points, extended
    by the last segment's slope, never decreasing."""

    tokens: tuple[int, ...]
    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.tokens) < 2 or list(self.tokens) != sorted(set(self.tokens)):
            raise ValueError(f"a step curve needs two or more increasing token counts, got {self.tokens}")
        rising = [max(self.seconds[:i + 1]) for i in range(len(self.seconds))]
        object.__setattr__(self, "seconds", tuple(rising))

    def __call__(self, n: int) -> float:
        t, s = self.tokens, self.seconds
        i = min(max(bisect.bisect_right(t, n) - 1, 0), len(t) - 2)
        slope = (s[i + 1] - s[i]) / (t[i + 1] - t[i])
        return max(s[i] + slope * (n - t[i]), 0.0)


def choose_lengths(confidence: list[list[float]], curve: StepCurve, overhead: float = 0.0,
                   others: int = 0) -> list[int]:
    """Per request the number of its drafts to verify, the most expected tokens per second of a step
    of ``len(confidence)`` decodes (``others``: decodes without drafts in it too); ``overhead``:
    seconds the step costs whatever is chosen (drafting done already)."""
    decodes = len(confidence) + others
    ranked = []
    for i, conf in enumerate(confidence):
        p = 1.0
        for c in conf:
            p *= min(max(c, 0.0), 1.0)
            ranked.append((p, i))
    ranked.sort(key=lambda r: -r[0])  # stable: a request's drafts stay in order
    best, best_rate, gain = 0, decodes / (curve(decodes) + overhead), 0.0
    for n, (p, _) in enumerate(ranked, 1):
        gain += p
        rate = (decodes + gain) / (curve(decodes + n) + overhead)
        if rate > best_rate:
            best, best_rate = n, rate
    lengths = [0] * len(confidence)
    for _, i in ranked[:best]:
        lengths[i] += 1
    return lengths


class LoadAwareLength:
    """The choice for a running engine: the start-up curve, drafting's measured cost per batch size
    (by powers of two) and the confidences drafts typically get (per position, a running mean)."""

    def __init__(self, curve: StepCurve, k: int, smoothing: float = 0.1) -> None:
        self.curve, self.k, self.smoothing = curve, k, smoothing
        self.typical = [1.0] * k  # optimistic until drafts are seen
        self.draft_seconds: dict[int, float] = {}

    @staticmethod
    def _bucket(n: int) -> int:
        return 1 << max(n - 1, 0).bit_length()

    def drafting_cost(self, batch: int) -> float:
        return self.draft_seconds.get(self._bucket(batch), 0.0)

    def worth_drafting(self, batch: int, others: int = 0) -> bool:
        """Whether a step of ``batch`` decodes that may draft (and ``others`` that may not) is
        expected to yield more tokens a second drafting than not."""
        decodes = batch + others
        lengths = choose_lengths([self.typical] * batch, self.curve, 0.0, others)
        n = sum(lengths)
        if not n:
            return False
        gain = sum(sum(_prefix_products(self.typical)[:m]) for m in lengths)
        return (decodes + gain) / (self.curve(decodes + n) + self.drafting_cost(batch)) > decodes / self.curve(decodes)

    def drafted(self, batch: int, seconds: float, confidence: list[list[float]]) -> None:
        """Drafting ``batch`` requests took ``seconds`` and gave ``confidence``: remember both."""
        b, a = self._bucket(batch), self.smoothing
        had = self.draft_seconds.get(b)
        self.draft_seconds[b] = seconds if had is None else (1 - a) * had + a * seconds
        for k in range(self.k):
            seen = [c[k] for c in confidence if len(c) > k]
            if seen:
                self.typical[k] = (1 - a) * self.typical[k] + a * sum(seen) / len(seen)


def _prefix_products(conf: list[float]) -> list[float]:
    out, p = [], 1.0
    for c in conf:
        p *= c
        out.append(p)
    return out


def profile_verify(engine, k: int) -> StepCurve:
    """Time the target's verify step at start-up: batches of 1, 4, 16, 64 sequences (as many as
    the engine runs and its KV holds) of 1 and ``k + 1`` tokens each, the median of three runs."""
    from .draft_model import DraftSeq
    from ..runner import StepInputs

    config, runner, kv = engine.config, engine.runner, engine.components.kv_manager
    points: dict[int, float] = {}
    for batch in (1, 4, 16, 64):
        if batch > config.max_num_seqs:
            break
        for n in (1, k + 1):
            if batch * n > config.max_num_batched_tokens or batch * n in points:
                continue
            seqs = [DraftSeq(-1 - i, [], [0] * n) for i in range(batch)]
            states = [kv.allocate(s, n) for s in seqs]
            if any(st is None for st in states):
                for s, st in zip(seqs, states):
                    if st is not None:
                        kv.free(s, cache=False)
                break
            tables = kv.page_table.gather([st.row for st in states], -(-n // config.page_size))
            back = runner.model.token_history  # ids before each sequence's step the model reads: none here
            inputs = StepInputs([0] * (batch * n), [n] * batch, [0] * batch, tables, list(range(batch * n)), [], [],
                                history=[[-1] * back] * batch if back else [])
            runs = []
            for _ in range(4):  # the first warms up
                started = time.perf_counter()
                runner.run_with_peers(inputs)[0][-1, 0].item()  # the other ranks of a split attention too
                runs.append(time.perf_counter() - started)
            points[batch * n] = sorted(runs[1:])[1]
            for s in seqs:
                kv.free(s, cache=False)
    tokens = sorted(points)
    if len(tokens) < 2:
        raise ValueError("the verify step could not be timed at two sizes (too few pages or tokens per step)")
    curve = StepCurve(tuple(tokens), tuple(points[t] for t in tokens))
    logger.info("verify step: %s", ", ".join(f"{t} tokens {s * 1e3:.1f} ms" for t, s in zip(curve.tokens,
                                                                                          curve.seconds)))
    return curve
