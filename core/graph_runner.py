"""Decode steps through captured graphs: static buffers, batch-size buckets, replay with padding.

A graph replays the same device work on the same addresses, so every input a decode step needs
lives in a buffer made once, sized for the largest bucket; a step of ``n`` sequences is copied
into the first ``n`` rows and runs the graph of the smallest bucket that holds it. Padding rows
decode token 0 at position 0 over one key, written to and read from the null page (page 0),
which no sequence ever owns; their logits are dropped. The attention backend must be
``graph_safe``: it reads the batch's lengths from the device tensors only, never from the host
lists, which in a captured batch are placeholders (each sequence's bound, ``max_model_len``).

Speculative decoding adds two things. Graphs of a fixed ``query_len`` per sequence hold its verify
steps (the last token and K drafts each, K+1 logits rows each), where the attention backends take
that many queries a sequence in a graph (``graph_query_len``: causal among them, lengths from the
device); padding rows bring ``query_len`` tokens at positions 0.. on the null page. And where the
proposer drafts from the target's per-token features (MTP's streams, DSpark's chosen layers), the
graphs are captured asking for them, so the feature is one more static output, of which a replay
hands back a copy (the next replay overwrites it).

The static integer arrays of bucket ``b`` lie in one device buffer as the layout of a forward
batch of ``b`` sequences puts them (core/forward.py), so a step packs its rows and the padding
rows on the host and sends them with one copy. The page table is the exception: its rows have the
full width there, so the step's narrower table goes at the end of that copy and one device copy
moves it into place (a full-width table from the host would grow with ``max_model_len``).

MoE exchanges between ranks are captured padded (``padded_exchanges``, core/distributed/moe.py):
their sizes follow from the bucket. Under data-parallel attention the ranks' batches differ, so
they agree on the graph and bucket every one replays (core/graph_choice.py), a rank with nothing
scheduled replaying it on padding only (``pad``).
"""

from __future__ import annotations

import logging
from typing import Callable

import numpy as np
import torch
from tqdm import tqdm

from .distributed.moe import padded_exchanges
from .families.graphs import GraphBackend
from .graph_choice import smallest_holding
from .forward import ForwardBatch, HostStaging, PageTables, batch_layout, pack_batch, page_table_array
from .kv.storage import KVCache
from .models.base import CausalLM

logger = logging.getLogger(__name__)


def decode_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 64, every 16 up to 256, every 32 beyond; ending at max_batch."""
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b = b * 2 if b < 8 else b + (8 if b < 64 else 16 if b < 256 else 32)
    return sizes + [max_batch]


class DecodeGraphs:
    def __init__(self, model: CausalLM, kv: KVCache, backend: GraphBackend, page_size: int, max_model_len: int,
                 max_batch: int, device: torch.device, query_len: int = 1,
                 feature: str | None = None, feature_layers: tuple[int, ...] = ()) -> None:
        """``query_len``: the new tokens of every sequence; ``feature``,
        ``feature_layers``: what the proposer drafts from (ForwardBatch.features), if it does."""
        self.model = model
        self.query_len = query_len
        self.feature = feature
        self.feature_layers = feature_layers
        self.kv = kv
        self.backend = backend
        self.page_size = page_size
        self.max_model_len = max_model_len
        self.buckets = decode_buckets(max_batch)
        b, width = max_batch, -(-max_model_len // page_size)
        t = b * query_len
        self.packed = torch.zeros(batch_layout(t, b, t, width).nbytes, dtype=torch.uint8, device=device)
        self.page_table = torch.zeros(b, width, dtype=torch.int32, device=device)
        self.staging = HostStaging(device)
        self._views: tuple = (None, None)  # (layout, host buffer) and the views a step of it writes and copies
        # bucket -> its replay (the logits) and the feature it leaves (or None)
        self._replays: dict[int, tuple[Callable[[], torch.Tensor], torch.Tensor | None]] = {}

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def _batch(self, b: int) -> ForwardBatch:
        self._stage(b, [], [], np.zeros((0, 1), dtype=np.int32))  # all padding, so the warm-up runs of the capture read sane lengths
        q, t = self.query_len, b * self.query_len
        v = batch_layout(t, b, t, 0).views(self.packed)
        v["page_table"] = self.page_table[:b]
        batch = ForwardBatch(**v, page_size=self.page_size, query_lens_cpu=[q] * b,
                             seq_lens_cpu=[self.max_model_len] * b, context_lens_cpu=[self.max_model_len - q] * b)
        if self.feature is not None:
            batch.features, batch.feature_layers = {}, self.feature_layers
        batch.attn_metadata = self.model.prepare(batch)
        return batch

    def capture(self, memory_budget: int | None = None, progress: bool = True) -> None:
        """Capture every bucket, largest first, stopping early past ``memory_budget`` bytes."""
        with torch.inference_mode(), padded_exchanges():  # as the steps run: no autograd state recorded
            self._capture(memory_budget, progress)

    def _capture(self, memory_budget: int | None, progress: bool) -> None:
        start = self.backend.memory_in_use()
        for b in tqdm(sorted(self.buckets, reverse=True), desc=f"capturing {self.kind} graphs", disable=not progress):
            self.kv.window_table()  # staged window pages land before the capture, never inside it
            self.kv.loads.flush()  # and pages loaded from host memory
            batch = self._batch(b)
            replay = self.backend.capture(lambda batch=batch: self.model.compute_logits(self.model(batch, self.kv)))
            # the capture's own run (the last) made the feature the replays write
            self._replays[b] = replay, None if self.feature is None else batch.features[self.feature]
            used = self.backend.memory_in_use() - start
            # the ranks stop at one bucket together: a replay's collectives meet only the same graph on every rank
            if memory_budget is not None and self.model.backends.moe_group.anyone(used > memory_budget,
                                                                                  self.packed.device):
                logger.warning("%s graphs took %.0f MiB, past the budget of %.0f MiB: stopped at batch %d",
                               self.kind, used / 2**20, memory_budget / 2**20, b)
                break
        self.buckets = sorted(self._replays)
        logger.info("captured %d %s graphs (batch %d to %d) in %.0f MiB", len(self.buckets), self.kind,
                    self.buckets[0], self.buckets[-1], (self.backend.memory_in_use() - start) / 2**20)

    @property
    def kind(self) -> str:
        return "decode" if self.query_len == 1 else f"verify ({self.query_len} tokens a sequence)"

    def can_run(self, query_lens: list[int], page_tables: PageTables, num_logits: int, features: bool = False) -> bool:
        """A step that a graph holds: ``query_len`` tokens and as many logits rows per sequence;
        ``features``: it asks for the proposer's feature."""
        n = len(query_lens)
        return bool(self._replays) and 0 < n <= self.buckets[-1] and num_logits == n * self.query_len \
            and query_lens.count(self.query_len) == n and (not features or self.feature is not None) \
            and page_table_array(page_tables).shape[1] <= self.page_table.shape[1]

    def pad(self, b: int) -> None:
        """Replay bucket ``b`` on padding rows only: this process's part of the other ranks' step."""
        self._stage(b, [], [], np.zeros((0, 1), dtype=np.int32))
        self.kv.window_table()
        self._replays[b][0]()

    def run(self, input_ids: list[int], context_lens: list[int], page_tables: PageTables,
            fill: Callable[[torch.Tensor], None] | None = None, bucket: int | None = None,
            features: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """fp32 logits [n * query_len, vocab] of a step of n sequences, through ``bucket`` (the agreed one)
        or the smallest bucket >= n; ``fill`` writes, on the device, the input ids the host does not
        have yet into the staged ones; ``features``, where given, gets a copy of the step's feature."""
        t = len(input_ids)
        b = bucket or smallest_holding(self.buckets, t // self.query_len)
        staged_ids = self._stage(b, input_ids, context_lens, page_table_array(page_tables))
        if fill is not None:
            fill(staged_ids)
        self.kv.window_table()  # the replay reads the window table as it is: apply the staged changes first
        replay, feature = self._replays[b]
        logits = replay()[:t]
        if features is not None:
            features[self.feature] = feature[:t].clone()
        return logits

    def _stage(self, b: int, input_ids: list[int], context_lens: list[int], page_table: np.ndarray) -> torch.Tensor:
        """Fill bucket ``b``'s static buffers with these rows, padding rows after them (one key on
        page 0); returns the bucket's input ids on the device."""
        q = self.query_len
        pad, t = b - len(context_lens), b * q
        short = -(-q // self.page_size) - page_table.shape[1]
        if short > 0:  # the padding rows' q positions span that many columns (of the null page)
            page_table = np.pad(page_table, ((0, 0), (0, short)))
        layout = batch_layout(t, b, t, page_table.shape[1])
        host = self.staging.take(layout.nbytes)
        key = (layout, host.data_ptr())
        if self._views[0] != key:  # steps repeat a layout until the table widens: views made once for it
            device = layout.views(self.packed)
            self._views = key, (layout.views(host.numpy()), self.packed[:layout.nbytes], device["page_table"],
                                self.page_table[:b, :layout.width], device["input_ids"])
        fields, packed, table, static_table, staged_ids = self._views[1]
        pack_batch(fields, input_ids + [0] * (pad * q), [q] * b, context_lens + [0] * pad, page_table, self.page_size,
                   range(t))  # the rows past the table's are padding
        self.staging.send(host, packed)
        static_table.copy_(table)
        return staged_ids
