"""The model runner: turns a scheduled step into one forward batch, or into a replay of the decode
graph that holds it, and returns its logits. Input tokens the host has not seen yet (the draws of
the step still in flight) are read from the token table on the device; the page tables are the
rows the KV manager keeps (core/kv/page_table.py), gathered in one call."""

from __future__ import annotations

from dataclasses import dataclass
from operator import add

import torch

from .forward import ForwardBatch, HostStaging
from .graph_runner import DecodeGraphs
from .kv.page_table import PageTable
from .kv.storage import KVCache
from .models.base import CausalLM
from .scheduler import SchedulerOutput
from .token_table import TokenTable


@dataclass
class StepLogits:
    logits: torch.Tensor  # [N, vocab] fp32
    rows: list[tuple[int, int]]  # per scheduled sequence: (first logits row, number of rows)


class ModelRunner:
    def __init__(self, model: CausalLM, kv: KVCache, table: TokenTable, page_table: PageTable, page_size: int,
                 device: torch.device, graphs: DecodeGraphs | None = None) -> None:
        self.model = model
        self.kv = kv
        self.table = table
        self.page_table = page_table
        self.page_size = page_size
        self.device = device
        self.graphs = graphs
        self.staging = HostStaging(device)  # the host side of every eager batch's copy, reused

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput) -> StepLogits:
        if step.page_copies:
            src, dst = zip(*step.page_copies)
            self.kv.copy_pages(list(src), list(dst))
        input_ids, query_lens, context_lens, tables, logits_indices, rows, (table_rows, slots) = self._gather(step)
        fill = (lambda ids: self.table.fill(ids, table_rows, slots)) if slots else None
        if self.graphs is not None and self.graphs.can_run(query_lens, tables, len(logits_indices)):
            return StepLogits(self.graphs.run(input_ids, context_lens, tables, fill), rows)
        batch = ForwardBatch.build(input_ids, query_lens, context_lens, tables, self.page_size, logits_indices,
                                   device=self.device, staging=self.staging)
        if fill is not None:
            fill(batch.input_ids)
        batch.attn_metadata = self.model.prepare(batch)
        hidden = self.model(batch, self.kv)
        if batch.logits_indices.numel() == 0:
            return StepLogits(hidden.new_empty((0, self.model.config.vocab_size), dtype=torch.float32), rows)
        return StepLogits(self.model.compute_logits(hidden[batch.logits_indices]), rows)

    def _gather(self, step: SchedulerOutput):
        """The step's batch as host lists and its page table, each sequence's (first logits row,
        number of rows), and the packed rows whose input is read from the token table with the slots
        they read."""
        query_lens = [s.num_new for s in step.scheduled]
        context_lens = [s.context_len for s in step.scheduled]
        longest = max(map(add, context_lens, query_lens))
        tables = self.page_table.gather([s.kv.row for s in step.scheduled], -(-longest // self.page_size))
        input_ids: list[int] = []
        logits_indices: list[int] = []
        rows: list[tuple[int, int]] = []
        table_rows: list[int] = []
        slots: list[int] = []
        for s in step.scheduled:
            seq, start = s.seq, len(input_ids)
            if s.in_flight:  # its token is not on the host yet: a 0 here, the table's value in the batch
                table_rows.append(start)
                slots.append(seq.slot)
                input_ids.append(0)
            else:
                input_ids.extend(seq.token_slice(s.context_len, s.context_len + s.num_new))
            if s.needs_all_logits:
                rows.append((len(logits_indices), s.num_new))
                logits_indices.extend(range(start, start + s.num_new))
            elif s.samples:
                rows.append((len(logits_indices), 1))
                logits_indices.append(start + s.num_new - 1)
            else:
                rows.append((len(logits_indices), 0))
        return input_ids, query_lens, context_lens, tables, logits_indices, rows, (table_rows, slots)
