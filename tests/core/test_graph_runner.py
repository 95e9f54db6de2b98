"""The decode graphs' static buffers, step after step, against eager batches; and which steps the
runner sends through a graph.

A stand-in model echoes what the batch says of each token, so every field a captured graph reads
is compared (the Triton test in tests/backends/triton checks real logits on a few steps).
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from engine.core.families.graphs import GraphBackend
from engine.core.forward import ForwardBatch
from engine.core.graph_runner import DecodeGraphs
from engine.core.kv.manager import KVManager
from engine.core.kv.storage import KVCache, KVLayerSpec
from engine.core.runner import ModelRunner
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import ScheduledSeq, SchedulerOutput
from engine.core.sequence import Sequence
from engine.core.token_table import TokenTable

CPU = torch.device("cpu")


class ReplayByRerun(GraphBackend):
    """Replays by calling the function again: the semantics of a graph, without a device."""

    name = "rerun"

    def capture(self, fn):
        fn()
        return fn


class Echo:
    """Each token's output row: its id, position and slot, its sequence's lengths and query span, and
    the page ids its sequence's length needs (-1 past them: no kernel reads those)."""

    token_history = 0  # no ids read on the host (CausalLM.token_history)
    replay_tail = 0  # every layer over every token (CausalLM.replay_tail)

    def __init__(self, page_size: int, width: int) -> None:
        self.page_size, self.width = page_size, width
        self.last: torch.Tensor | None = None
        self.batches: list[ForwardBatch] = []

    def __call__(self, batch: ForwardBatch, kv) -> torch.Tensor:
        self.batches.append(batch)
        starts = batch.query_start_loc.long()
        owner = torch.repeat_interleave(torch.arange(len(starts) - 1), starts.diff())
        seq = torch.stack([batch.seq_lens.long(), batch.context_lens.long(), starts[:-1], starts[1:]], 1)
        table = F.pad(batch.page_table.long(), (0, self.width - batch.page_table.shape[1]), value=-1)
        needed = -(-batch.seq_lens.long() // self.page_size)
        table = table.masked_fill(torch.arange(self.width) >= needed[:, None], -1)
        token = torch.stack([batch.input_ids, batch.positions, batch.slot_mapping], 1)
        self.last = torch.cat([token, seq[owner], table[owner]], 1).float()
        return self.last

    def prepare(self, batch: ForwardBatch) -> None:
        return None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden


def make_graphs(rng: random.Random) -> tuple[DecodeGraphs, Echo]:
    page, max_len = rng.choice([1, 4, 16]), rng.choice([64, 200])
    echo = Echo(page, -(-max_len // page))
    kv = KVCache([KVLayerSpec(1, 4, 4)], 2, page, torch.float32, CPU)
    graphs = DecodeGraphs(echo, kv, ReplayByRerun(None), page, max_len, rng.choice([6, 12]), CPU)
    graphs.capture(progress=False)
    return graphs, echo


def test_each_step_fills_its_bucket_and_the_padding_rows(seed):
    rng = random.Random(seed)
    graphs, echo = make_graphs(rng)
    page, width = graphs.page_size, graphs.page_table.shape[1]
    for _ in range(40):  # buckets up and down, tables wide and narrow: rows stale from other steps
        n = rng.randint(1, graphs.max_batch)
        ctx = [rng.randrange(graphs.max_model_len) for _ in range(n)]
        tables = [rng.sample(range(1, 10000), min(width, -(-(c + 1) // page) + rng.randint(0, 2))) for c in ctx]
        ids = [rng.randrange(50000) for _ in range(n)]
        assert graphs.can_run([1] * n, tables, n)
        if rng.random() < 0.5:
            got = graphs.run(ids, ctx, tables)
        else:  # the ids on the device only, in a token table
            table = TokenTable(graphs.max_batch + 3, CPU)
            slots = rng.sample(range(1, table.num_slots + 1), n)
            table.write(slots, torch.tensor(ids))
            got = graphs.run([0] * n, ctx, tables, lambda staged: table.fill(staged, list(range(n)), slots))
        full = echo.last.clone()
        want = echo(ForwardBatch.build(ids, [1] * n, ctx, tables, page, list(range(n))), None)
        assert torch.equal(got, want)
        b = min(size for size in graphs.buckets if size >= n)
        assert full.shape[0] == b
        for i in range(n, b):  # token 0 at position 0, one key, on the null page
            assert full[i, :8].tolist() == [0, 0, 0, 1, 0, i, i + 1, 0]
            assert (full[i, 8:] == -1).all()


class EchoFeature(Echo):
    """Echo that also hands back a per-token feature where the batch asks (MTP's streams): twice its
    rows, in one buffer, as a graph's replays write the same memory (the first call, the capture of
    the largest bucket, sizes it)."""

    feature: torch.Tensor | None = None

    def __call__(self, batch: ForwardBatch, kv) -> torch.Tensor:
        out = super().__call__(batch, kv)
        if batch.features is not None:
            if self.feature is None:
                self.feature = torch.empty_like(out)
            batch.features["streams"] = torch.mul(out, 2, out=self.feature[:out.shape[0]])
        return out


@pytest.mark.parametrize("query_len", [1, 4])
def test_verify_graphs_stage_k_plus_one_tokens_and_hand_back_the_feature(seed, query_len):
    """Graphs of ``query_len`` tokens a sequence (speculative decoding's verify steps) captured with
    a feature: every field as an eager batch of that step has it, padding rows at positions 0.. on
    the null page, and a copy of the feature that the next replay leaves as it was."""
    rng = random.Random(seed)
    q, page, max_len = query_len, rng.choice([1, 4, 16]), 64
    echo = EchoFeature(page, -(-max_len // page))
    kv = KVCache([KVLayerSpec(1, 4, 4)], 2, page, torch.float32, CPU)
    graphs = DecodeGraphs(echo, kv, ReplayByRerun(None), page, max_len, 6, CPU, query_len=q, feature="streams")
    graphs.capture(progress=False)
    width, handed = graphs.page_table.shape[1], []
    with torch.inference_mode():  # as the runner replays
        for _ in range(12):
            n = rng.randint(1, graphs.max_batch)
            ctx = [rng.randrange(max_len - q) for _ in range(n)]
            tables = [rng.sample(range(1, 10000), min(width, -(-(c + q) // page) + rng.randint(0, 2))) for c in ctx]
            ids = [rng.randrange(50000) for _ in range(n * q)]
            assert graphs.can_run([q] * n, tables, n * q, features=True)
            assert q == 1 or not graphs.can_run([q] * n, tables, n, features=True)  # a row each: no verify step
            features = {}
            got = graphs.run(ids, ctx, tables, features=features)
            full = echo.last.clone()
            want = echo(ForwardBatch.build(ids, [q] * n, ctx, tables, page, list(range(n * q))), None)
            assert torch.equal(got, want) and torch.equal(features["streams"], want * 2)
            handed.append((features["streams"], want * 2))
            b = min(size for size in graphs.buckets if size >= n)
            for i in range(n, b):  # padding: q tokens at positions 0.., context 0, on the null page
                for j in range(q):
                    row = full[i * q + j]
                    assert row[:8].tolist() == [0, j, j % page, q, 0, i * q, (i + 1) * q, 0]
    assert all(torch.equal(kept, want) for kept, want in handed)


def test_graphs_refuse_what_they_do_not_hold(seed):
    graphs, _ = make_graphs(random.Random(seed))
    width, most = graphs.page_table.shape[1], graphs.max_batch
    assert graphs.can_run([1] * most, [[1]] * most, most)
    assert not graphs.can_run([1] * (most + 1), [[1]] * (most + 1), most + 1)
    assert not graphs.can_run([1, 2], [[1], [2]], 2)
    assert not graphs.can_run([1], [list(range(1, width + 2))], 1)
    assert not graphs.can_run([1, 1], [[1], [2]], 1)  # a sequence that draws no token has no logits row


def _scheduled(rng: random.Random, kv: KVManager, i: int, prompt_len: int, outputs: int, context_len=None,
               table: TokenTable | None = None) -> ScheduledSeq:
    """One token of a sequence after ``context_len`` tokens (default: its last token), on pages of
    ``kv`` for all of them. With ``table``, the token is one drawn on the device only: in the table at
    the sequence's slot."""
    seq = Sequence(i, f"r{i}", 0, [rng.randrange(50000) for _ in range(prompt_len)], SamplingParams())
    seq.output_token_ids = [rng.randrange(50000) for _ in range(outputs)]
    if table is not None:
        seq.slot, seq.num_pending = table.assign(), 1
        table.write([seq.slot], torch.tensor([rng.randrange(50000)]))
        context_len = seq.num_tokens
    state = kv.allocate(seq, seq.num_tokens + seq.num_pending)
    seq.num_computed = seq.num_tokens - 1 if context_len is None else context_len
    return ScheduledSeq.of(seq, 1, state)


def test_runner_sends_decode_steps_through_graphs_and_others_eagerly(seed):
    """A one-token prefill chunk draws nothing: beside decodes, its step must not take a graph, whose
    logits rows are one per sequence, or the decodes after it would read the wrong rows. Decodes
    whose token is still in flight read it from the token table, on either path."""
    rng = random.Random(seed)
    graphs, echo = make_graphs(rng)
    page = graphs.page_size
    for chunk in (False, True):
        table = TokenTable(2, CPU)  # grows as slots are taken
        kv = KVManager(1024, page)
        runner = ModelRunner(echo, graphs.kv, table, kv.page_table, page, CPU, graphs)
        step = SchedulerOutput()
        for i in range(rng.randint(2, graphs.max_batch)):
            step.scheduled.append(_scheduled(rng, kv, i, rng.randint(2, 30), rng.randint(1, 20),
                                             table=table if rng.random() < 0.6 else None))
        if chunk:
            prompt_len = rng.randint(3, 30)
            step.scheduled.insert(rng.randrange(len(step.scheduled)),
                                  _scheduled(rng, kv, 99, prompt_len, 0, rng.randrange(prompt_len - 2)))
        echo.batches.clear()
        out = runner.execute(step)
        through_graph = echo.batches[0].seq_lens_cpu[0] == graphs.max_model_len  # a captured batch's placeholder
        assert through_graph != chunk
        s = step.scheduled
        ids = [int(table.tokens[x.seq.slot]) if x.in_flight else x.seq.tokens[x.context_len] for x in s]
        want = echo(ForwardBatch.build(ids, [1] * len(s), [x.context_len for x in s], [x.kv.pages for x in s], page,
                                       list(range(len(s)))), None)
        for i, x in enumerate(s):
            if x.samples:
                start, count = out.rows[i]
                assert torch.equal(out.logits[start + count - 1], want[i])
