"""Decode steps through captured graphs: static buffers, batch-size buckets, replay with padding.

A graph replays the same device work on the same addresses, so every input a decode step needs
lives in a buffer made once, sized for the largest bucket; a step of ``n`` sequences is copied
into the first ``n`` rows and runs the graph of the smallest bucket that holds it. Padding rows
decode token 0 at position 0 over one key, written to and read from the null page (page 0),
which no sequence ever owns; their logits are dropped. The attention backend must be
``graph_safe``: it reads the batch's lengths from the device tensors only, never from the host
lists, which in a captured batch are placeholders (each sequence's bound, ``max_model_len``).
"""

from __future__ import annotations

import logging
from typing import Callable

import torch
from tqdm import tqdm

from .families.graphs import GraphBackend
from .forward import ForwardBatch
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
                 max_batch: int, device: torch.device) -> None:
        self.model = model
        self.kv = kv
        self.backend = backend
        self.page_size = page_size
        self.max_model_len = max_model_len
        self.buckets = decode_buckets(max_batch)
        b, width = max_batch, -(-max_model_len // page_size)
        i64, i32 = dict(dtype=torch.int64, device=device), dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(b, **i64)
        self.positions = torch.zeros(b, **i64)
        self.query_start_loc = torch.arange(b + 1, **i32)
        self.seq_lens = torch.ones(b, **i32)
        self.context_lens = torch.zeros(b, **i32)
        self.page_table = torch.zeros(b, width, **i32)
        self.slot_mapping = torch.zeros(b, **i64)
        self.logits_indices = torch.arange(b, **i64)
        self._replays: dict[int, Callable[[], torch.Tensor]] = {}

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def _batch(self, b: int) -> ForwardBatch:
        batch = ForwardBatch(
            input_ids=self.input_ids[:b], positions=self.positions[:b], query_start_loc=self.query_start_loc[:b + 1],
            seq_lens=self.seq_lens[:b], context_lens=self.context_lens[:b], page_table=self.page_table[:b],
            slot_mapping=self.slot_mapping[:b], logits_indices=self.logits_indices[:b], page_size=self.page_size,
            query_lens_cpu=[1] * b, seq_lens_cpu=[self.max_model_len] * b, context_lens_cpu=[self.max_model_len - 1] * b)
        batch.attn_metadata = self.model.backends.attention.prepare(batch)
        return batch

    def capture(self, memory_budget: int | None = None, progress: bool = True) -> None:
        """Capture every bucket, largest first, stopping early past ``memory_budget`` bytes."""
        with torch.inference_mode():  # as the steps run: no autograd state recorded into the graphs
            self._capture(memory_budget, progress)

    def _capture(self, memory_budget: int | None, progress: bool) -> None:
        start = self.backend.memory_in_use()
        for b in tqdm(sorted(self.buckets, reverse=True), desc="capturing decode graphs", disable=not progress):
            batch = self._batch(b)
            self._replays[b] = self.backend.capture(lambda batch=batch: self.model.compute_logits(self.model(batch, self.kv)))
            used = self.backend.memory_in_use() - start
            if memory_budget is not None and used > memory_budget:
                logger.warning("decode graphs took %.0f MiB, past the budget of %.0f MiB: stopped at batch %d",
                               used / 2**20, memory_budget / 2**20, b)
                break
        self.buckets = sorted(self._replays)
        logger.info("captured %d decode graphs (batch %d to %d) in %.0f MiB", len(self.buckets), self.buckets[0],
                    self.buckets[-1], (self.backend.memory_in_use() - start) / 2**20)

    def can_run(self, batch: ForwardBatch) -> bool:
        return bool(self._replays) and batch.is_decode and batch.num_seqs <= self.buckets[-1] \
            and batch.page_table.shape[1] <= self.page_table.shape[1]

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """fp32 logits [n, vocab] of a decode batch of n sequences, through the smallest bucket >= n."""
        n = batch.num_seqs
        b = next(size for size in self.buckets if size >= n)
        width = batch.page_table.shape[1]
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.seq_lens[:n].copy_(batch.seq_lens)
        self.context_lens[:n].copy_(batch.context_lens)
        self.page_table[:n, :width].copy_(batch.page_table)
        self.slot_mapping[:n].copy_(batch.slot_mapping)
        if b > n:  # padding rows: one key at slot 0 of the null page
            for t in (self.input_ids, self.positions, self.context_lens, self.slot_mapping):
                t[n:b].zero_()
            self.seq_lens[n:b].fill_(1)
            self.page_table[n:b, 0].zero_()
        return self._replays[b]()[:n]
