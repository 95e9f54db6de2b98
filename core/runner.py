"""The model runner: turns a scheduled step into one forward batch, or into a replay of the decode
graph that holds it (a verify step of speculative decoding: of the verify graph), and returns its
logits. Input tokens the host has not seen yet (the draws of the step still in flight) are read
from the token table on the device; the page tables are the rows the KV manager keeps
(core/kv/page_table.py), gathered in one call.

A step's batch is first its host data (``StepInputs``), then a forward. Under tensor parallelism
rank 0's runner sends that data to the other ranks (``peers``, core/distributed/workers.py), whose
runners run the same forward; the tokens only rank 0's device holds are broadcast from there into
every rank's batch."""

from __future__ import annotations

from dataclasses import dataclass
from operator import add
from typing import Callable, Iterator, Protocol

import msgspec
import numpy as np
import torch

from .distributed.group import SINGLE, ParallelGroup
from .distributed.moe import idle_forward
from .forward import ForwardBatch, HostStaging
from .graph_choice import GraphChoice
from .graph_runner import DecodeGraphs
from .prefill_graphs import PrefillGraphs
from .kv.page_table import PageTable
from .kv.storage import KVCache
from .models.base import CausalLM
from .scheduler import SchedulerOutput
from .token_table import TokenTable


@dataclass
class StepLogits:
    logits: torch.Tensor  # [N, vocab] fp32
    rows: list[tuple[int, int]]  # per scheduled sequence: (first logits row, number of rows)
    features: torch.Tensor | None = None  # per packed token, where asked (``ModelRunner.feature``)


class StepInputs(msgspec.Struct, array_like=True, gc=False):
    """One step's batch as host data: all a rank needs to run it."""

    input_ids: list[int]  # packed; 0 where the token is still on the device (``in_flight``)
    query_lens: list[int]
    context_lens: list[int]
    tables: np.ndarray  # [sequences, pages] page table rows
    logits_indices: list[int]
    in_flight: list[int]  # packed rows whose input token is on rank 0's device only (ascending)
    page_copies: list[tuple[int, int]]  # KV pages to copy (src, dst) before the forward
    windows: list[tuple[int, int]] = []  # window pages the KV manager assigned since the last step (page, window)
    # per sequence the model's ``token_history`` ids before its new ones (-1 before its start), where it reads them
    history: list[list[int]] = []
    prompt_ends: list[int] = []  # per sequence its length, where the model's ``replay_tail`` asks


class Peers(Protocol):
    """The other ranks of a tensor-parallel group, seen from the one that schedules (rank 0, or under
    data-parallel attention each data-parallel rank's first process)."""

    def send_step(self, inputs: StepInputs) -> None: ...

    def send(self, message) -> None:
        """Another message to every rank: a proposer's drafting forward (core/spec/mtp.py)."""

    def explain(self, exc: BaseException) -> None:
        """Raise the failure of a rank that made a step fail with ``exc``, if one failed."""


class ModelRunner:
    def __init__(self, model: CausalLM, kv: KVCache, table: TokenTable | None, page_table: PageTable | None,
                 page_size: int, device: torch.device, graphs: DecodeGraphs | None = None,
                 group: ParallelGroup = SINGLE, peers: Peers | None = None,
                 prefill_graphs: PrefillGraphs | None = None, verify_graphs: DecodeGraphs | None = None,
                 agree: ParallelGroup = SINGLE) -> None:
        """``table`` and ``page_table`` belong to the rank that schedules (None on the others);
        ``group`` is the tensor-parallel group, ``peers`` what rank 0 sends every step to;
        ``verify_graphs``: speculative decoding's verify steps of K+1 tokens a sequence;
        ``prefill_graphs`` run the steps no decode or verify graph holds, where their tokens fit;
        ``agree``: under data-parallel attention, where every process agrees on the graph each step
        replays (core/graph_choice.py; ``Components.plan_group``)."""
        self.model = model
        self.kv = kv
        self.table = table
        self.page_table = page_table
        self.page_size = page_size
        self.device = device
        self.group = group
        self.peers = peers
        self.choice = GraphChoice([graphs, verify_graphs, prefill_graphs], agree)  # in this order of preference
        self.staging = HostStaging(device)  # the host side of every eager batch's copy, reused
        # the per-token feature a proposer drafts from (ForwardBatch.features), if one does: every
        # step asks for it, and the graphs were captured asking for it
        self.feature: str | None = None
        self.feature_layers: tuple[int, ...] = ()  # where the feature is "layers": which

    @property
    def graphs(self) -> DecodeGraphs | None:
        return self.choice.kinds[0]

    @property
    def verify_graphs(self) -> DecodeGraphs | None:
        return self.choice.kinds[1]

    @property
    def prefill_graphs(self) -> PrefillGraphs | None:
        return self.choice.kinds[2]

    def execute(self, step: SchedulerOutput) -> StepLogits:
        inputs, rows, slots = self._gather(step)
        logits, features = self.run_with_peers(inputs, slots)
        return StepLogits(logits, rows, features)

    def run_with_peers(self, inputs: StepInputs, slots: list[int] | None = None) -> tuple[torch.Tensor,
                                                                                         torch.Tensor | None]:
        """The step's logits and, where a proposer asks, the feature it drafts from (whole on this rank:
        the model's all-reduces make it so), with the ``peers`` running the step beside this rank."""
        if self.peers is None:
            return self._run_features(inputs, slots)
        self.peers.send_step(inputs)
        try:
            return self._run_features(inputs, slots)
        except Exception as exc:  # a collective failed: because a rank died, if one did
            self.peers.explain(exc)
            raise

    def follow(self, inputs: StepInputs) -> torch.Tensor:
        """Run a step rank 0 scheduled (on another rank): its KV manager's window pages first."""
        for page, window in inputs.windows:
            self.kv.stage_window(page, window)
        return self.run(inputs)

    @torch.inference_mode()
    def idle(self) -> None:
        """This process's part of a step of the other data-parallel ranks, with nothing scheduled
        here: a replay of padding where they replay a graph, else a forward of no tokens."""
        if not self.choice.idle():
            idle_forward(self.model)

    def _run_features(self, inputs: StepInputs, slots: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step's logits and, where a proposer asks, the feature it drafts from."""
        if self.feature is None:
            return self.run(inputs, slots), None
        features: dict[str, torch.Tensor] = {}
        return self.run(inputs, slots, features), features[self.feature]

    @torch.inference_mode()
    def run(self, inputs: StepInputs, slots: list[int] | None = None,
            features: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """The logits [len(logits_indices), vocab] of one step; ``slots``: the token table slots
        that ``inputs.in_flight`` read (on rank 0; the other ranks get those tokens from it);
        ``features``: a dict the model fills with its per-token features (ForwardBatch.features)."""
        if inputs.page_copies:
            src, dst = zip(*inputs.page_copies)
            self.kv.copy_pages(list(src), list(dst))
        fill = self._fill(inputs.in_flight, slots)
        if self.model.token_history:  # its host work from the step's ids (host-placed Engram rows), before its layers
            if len(inputs.history) != len(inputs.query_lens):
                raise RuntimeError(f"{type(self.model).__name__} reads {self.model.token_history} ids before each "
                                   f"sequence's step on the host, but the step brings them for "
                                   f"{len(inputs.history)} of {len(inputs.query_lens)} sequences")
            self.model.stage(inputs.input_ids, inputs.query_lens, inputs.history)
        prefill = self.prefill_graphs
        chosen = self.choice.choose(self._sizes(inputs, features))
        if chosen is not None and chosen[0] is not prefill:
            graphs, bucket = chosen
            self.kv.loads.flush()  # a replay asks no layer for its arrays: host-memory hits land first
            return graphs.run(inputs.input_ids, inputs.context_lens, inputs.tables, fill, bucket, features)
        batch = ForwardBatch.build(inputs.input_ids, inputs.query_lens, inputs.context_lens, inputs.tables,
                                   self.page_size, inputs.logits_indices, device=self.device, staging=self.staging)
        if fill is not None:
            fill(batch.input_ids)
        batch.prompt_ends_cpu = inputs.prompt_ends
        batch.features = features
        if features is not None:
            batch.feature_layers = self.feature_layers
        graphed = chosen is not None
        if graphed:  # a replay asks no layer for its arrays: host-memory hits land first
            self.kv.loads.flush()
        else:
            self.kv.loads.start()  # host-memory hits load layer by layer while the layers compute
        try:
            batch.attn_metadata = self.model.prepare(batch)
            hidden = prefill.run(batch, chosen[1]) if graphed else self.model(batch, self.kv)
        finally:
            self.kv.loads.finish()
        if batch.logits_indices.numel() == 0:
            return hidden.new_empty((0, self.model.config.vocab_size), dtype=torch.float32)
        return self.model.compute_logits(hidden[batch.logits_indices])

    def _sizes(self, inputs: StepInputs, features: dict | None) -> Iterator[int | None]:
        """The step's size in each kind of graph (``GraphChoice``), None where the kind does not hold it."""
        n, t = len(inputs.query_lens), len(inputs.input_ids)
        yield n if self._holds(self.graphs, inputs, features) else None
        yield n if self._holds(self.verify_graphs, inputs, features) else None
        prefill = self.prefill_graphs
        yield t if prefill is not None and prefill.holds(t, features is not None) else None

    @staticmethod
    def _holds(graphs: DecodeGraphs | None, inputs: StepInputs, features: dict | None) -> bool:
        return graphs is not None and graphs.can_run(inputs.query_lens, inputs.tables, len(inputs.logits_indices),
                                                     features is not None)

    def _fill(self, rows: list[int], slots: list[int] | None) -> Callable[[torch.Tensor], None] | None:
        """What writes the input ids the host lacks into a staged batch's ids: read from the token
        table, and broadcast from rank 0 to the other ranks."""
        if not rows:
            return None
        if self.group.size == 1:
            return lambda ids: self.table.fill(ids, rows, slots)
        if slots is None:
            return lambda ids: self.group.broadcast(ids, src=0)
        return lambda ids: (self.table.fill(ids, rows, slots), self.group.broadcast(ids, src=0))

    def _gather(self, step: SchedulerOutput) -> tuple[StepInputs, list[tuple[int, int]], list[int]]:
        """The step's batch as host data, each sequence's (first logits row, number of rows), and the
        token table slots its in-flight rows read."""
        query_lens = [s.num_new for s in step.scheduled]
        context_lens = [s.context_len for s in step.scheduled]
        longest = max(map(add, context_lens, query_lens))
        tables = self.page_table.gather([s.kv.row for s in step.scheduled], -(-longest // self.page_size))
        input_ids: list[int] = []
        logits_indices: list[int] = []
        rows: list[tuple[int, int]] = []
        table_rows: list[int] = []
        slots: list[int] = []
        back = self.model.token_history
        history: list[list[int]] = []
        for s in step.scheduled:
            seq, start = s.seq, len(input_ids)
            if back:
                if s.in_flight:
                    raise RuntimeError(f"{type(self.model).__name__} reads each step's token ids on the host, but "
                                       f"sequence {seq.request_id}'s is still on the device (decode overlap)")
                before = seq.token_slice(max(0, s.context_len - back), s.context_len)
                history.append([-1] * (back - len(before)) + before)
            if s.in_flight:  # its token is not on the host yet: a 0 here, the table's value in the batch
                table_rows.append(start)
                slots.append(seq.slot)
                input_ids.append(0)
            elif s.drafts:  # its last token and its drafts, each verified by the logits of the one before
                input_ids.extend(seq.token_slice(s.context_len, s.context_len + 1))
                input_ids.extend(s.drafts)
            else:
                input_ids.extend(seq.token_slice(s.context_len, s.context_len + s.num_new))
            if s.needs_all_logits or s.drafts:
                rows.append((len(logits_indices), s.num_new))
                logits_indices.extend(range(start, start + s.num_new))
            elif s.samples:
                rows.append((len(logits_indices), 1))
                logits_indices.append(start + s.num_new - 1)
            else:
                rows.append((len(logits_indices), 0))
        ends = [s.seq.num_tokens for s in step.scheduled] if self.model.replay_tail else []
        inputs = StepInputs(input_ids, query_lens, context_lens, tables, logits_indices, table_rows,
                            step.page_copies, self.kv.staged_windows() if self.peers is not None else [], history,
                            ends)
        return inputs, rows, slots
