"""Prefill steps through breakable graphs: the forward recorded in segments per token-count bucket.

A step's work outside attention (embeddings, projections, norms, MLPs, graph-safe MoEs) is the
same for any batch of its token count, so it is recorded once per bucket and replayed; the breaks
between the segments (core/breaks.py) run eagerly on the step's own batch. The segments read two
static buffers, the token ids and positions, where a step of ``n`` tokens is copied into the
first ``n`` rows of the smallest bucket that holds it, the rest zero; the padding rows flow
through the segments and never reach a break, so no padded token reads or writes a KV page. The
logits are taken eagerly from the replay's hidden states, for the rows the step asks for.

Every bucket is recorded once at start-up on a placeholder batch of one sequence on the null
page; all segments share the graph backend's memory pool, and what the recording freed is reused
by what it allocated later (``GraphBackend.unowned``), so a bucket holds about one layer's
temporaries. Buckets are recorded smallest first, and the capture stops at one that does not fit
in memory or past the budget: the larger steps it leaves eager are those whose kernels take
longest beside their launches, where a graph gains least. Steps that run a decode graph or that
exceed the largest bucket captured run as before.

Under expert parallelism or data-parallel attention the MoE exchanges are recorded padded
(``padded_exchanges``, core/distributed/moe.py): every rank sends every other a block sized by the
bucket, and the breaks inside an exchange (a MoE backend that reads the host) take its blocks
whole. The ranks capture the same buckets (they stop together), and under data-parallel attention
agree on the bucket each step replays (core/graph_choice.py), a rank with no tokens that step
replaying the placeholder batch of the capture (``pad``: its KV on the null page).

Where a proposer drafts from the target's per-token features (MTP's streams, DSpark's chosen
layers), every bucket is recorded asking for them, so the feature is one more static output: the
steps of such an engine all ask for it (decodes, prefill chunks, the verify steps of K+1 tokens a
sequence), and a replay hands back a copy of its rows, since the next replay overwrites them.
"""

from __future__ import annotations

import logging
import time

import torch
from tqdm import tqdm

from .breaks import BreakPoints, SegmentRecorder
from .distributed.moe import padded_exchanges
from .families.graphs import GraphBackend
from .forward import ForwardBatch
from .graph_choice import smallest_holding
from .kv.storage import KVCache
from .models.base import CausalLM

logger = logging.getLogger(__name__)


def prefill_buckets(max_tokens: int) -> list[int]:
    """16, 32, .. doubling to 512, then every 512; ending at max_tokens."""
    sizes, b = [], 16
    while b < max_tokens:
        sizes.append(b)
        b = b * 2 if b < 512 else b + 512
    return sizes + [max_tokens]


class PrefillGraphs:
    def __init__(self, model: CausalLM, kv: KVCache, backend: GraphBackend, points: BreakPoints, page_size: int,
                 max_tokens: int, device: torch.device, feature: str | None = None,
                 feature_layers: tuple[int, ...] = ()) -> None:
        """``feature``, ``feature_layers``: what the proposer drafts from (ForwardBatch.features), if it does."""
        self.model = model
        self.kv = kv
        self.backend = backend
        self.points = points
        self.page_size = page_size
        self.buckets = prefill_buckets(max_tokens)
        self.input_ids = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.device = device
        self.feature = feature
        self.feature_layers = feature_layers
        # bucket -> its steps, the hidden states and the feature (or None) its replays leave
        self._recorded: dict[int, tuple[SegmentRecorder, torch.Tensor, torch.Tensor | None]] = {}

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1]

    def holds(self, num_tokens: int, features: bool = False) -> bool:
        """Whether a step of ``num_tokens`` tokens replays here; ``features``: it asks for the feature."""
        return bool(self._recorded) and 0 < num_tokens <= self.buckets[-1] and (not features or bool(self.feature))

    def bucket(self, num_tokens: int) -> int:
        return smallest_holding(self.buckets, num_tokens)

    def recorder(self, bucket: int) -> SegmentRecorder:
        return self._recorded[bucket][0]

    def _batch(self, b: int) -> ForwardBatch:
        """One sequence of ``b`` tokens on the null page, its ids and positions in the static buffers."""
        batch = ForwardBatch.build([0] * b, [b], [0], [[0] * -(-b // self.page_size)], self.page_size, [b - 1],
                                   device=self.device)
        self.input_ids[:b].copy_(batch.input_ids)
        self.positions[:b].copy_(batch.positions)
        batch.input_ids, batch.positions = self.input_ids[:b], self.positions[:b]
        if self.feature is not None:
            batch.features, batch.feature_layers = {}, self.feature_layers
        batch.attn_metadata = self.model.prepare(batch)
        return batch

    def capture(self, memory_budget: int | None = None, progress: bool = True) -> None:
        """Record every bucket, smallest first, stopping past ``memory_budget`` bytes or where one
        does not fit."""
        with torch.inference_mode(), padded_exchanges():
            self._capture(memory_budget, progress)

    def _capture(self, memory_budget: int | None, progress: bool) -> None:
        start, started = self.backend.memory_in_use(), time.monotonic()
        self.kv.window_table()  # staged window pages and host-memory hits land before any recording
        self.kv.loads.flush()
        for b in tqdm(self.buckets, desc="capturing prefill graphs", disable=not progress):
            try:
                self._recorded[b] = self._record(b)
            except torch.OutOfMemoryError:
                if not self._recorded:
                    raise
                logger.warning("a prefill graph of %d tokens does not fit in memory: steps of more than %d tokens "
                               "run eagerly", b, max(self._recorded))
                break
            used = self.backend.memory_in_use() - start
            # the ranks stop at one bucket together: a replay's collectives meet only the same graph on every rank
            if memory_budget is not None and self.model.backends.moe_group.anyone(used > memory_budget,
                                                                                  self.device):
                logger.warning("prefill graphs took %.0f MiB, past the budget of %.0f MiB: steps of more than %d "
                               "tokens run eagerly", used / 2**20, memory_budget / 2**20, b)
                break
        self.buckets = sorted(self._recorded)
        breaks = len(self.recorder(self.buckets[-1]).breaks)
        logger.info("captured %d prefill graphs (%d to %d tokens), each %d segments around %d eager breaks, "
                    "in %.0f MiB and %.1fs", len(self.buckets), self.buckets[0], self.buckets[-1], breaks + 1,
                    breaks, (self.backend.memory_in_use() - start) / 2**20, time.monotonic() - started)

    def _record(self, b: int) -> tuple[SegmentRecorder, torch.Tensor, torch.Tensor | None]:
        """Bucket ``b``'s segments and breaks, and (unowned) the hidden states and feature its replays leave."""
        batch = self._batch(b)
        self.backend.warm_up(lambda: self.model(batch, self.kv))
        recorder = SegmentRecorder(self.backend, batch)
        self.points.recorder = recorder
        try:
            hidden = recorder.record(lambda: self.model(batch, self.kv))
        finally:
            self.points.recorder = None
        feature = None if self.feature is None else self.backend.unowned(batch.features[self.feature])
        return recorder, self.backend.unowned(hidden), feature  # read at once after each replay

    def run(self, batch: ForwardBatch, bucket: int | None = None) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] of the step ``batch`` (its attention metadata prepared),
        through ``bucket`` (the agreed one) or the smallest that holds it; where the step asks
        (``batch.features``), its feature too, copied."""
        n = batch.num_tokens
        b = bucket or self.bucket(n)
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.input_ids[n:b].zero_()
        self.positions[n:b].zero_()
        recorder, hidden, feature = self._recorded[b]
        recorder.replay(batch)
        if batch.features is not None:
            batch.features[self.feature] = feature[:n].clone()
        return hidden[:n]

    def pad(self, b: int) -> None:
        """Replay bucket ``b`` on the placeholder batch of its capture (one sequence on the null page):
        this process's part of the other ranks' step."""
        recorder = self.recorder(b)
        self.input_ids[:b].zero_()
        torch.arange(b, out=self.positions[:b])
        self.kv.window_table()
        self.kv.loads.flush()
        recorder.replay(recorder.batch)
