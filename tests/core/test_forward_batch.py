"""The forward batch packed in one buffer: every field as a plain per-token construction makes it."""

from __future__ import annotations

import random

import pytest
import torch

from engine.core.forward import ALIGN, NUMPY_DECODE_SLOTS, ForwardBatch, HostStaging

FIELDS = ("input_ids", "positions", "query_start_loc", "seq_lens", "context_lens", "page_table", "slot_mapping",
          "logits_indices")


def reference(input_ids, query_lens, context_lens, tables, page_size, logits_indices) -> dict[str, torch.Tensor]:
    """Each field one token at a time, from the definitions in ForwardBatch."""
    positions, slots, starts = [], [], [0]
    for q, c, pages in zip(query_lens, context_lens, tables):
        for pos in range(c, c + q):
            positions.append(pos)
            slots.append(pages[pos // page_size] * page_size + pos % page_size)
        starts.append(starts[-1] + q)
    width = max((len(p) for p in tables), default=0) or 1
    i32, i64 = dict(dtype=torch.int32), dict(dtype=torch.int64)
    return {"input_ids": torch.tensor(input_ids, **i64), "positions": torch.tensor(positions, **i64),
            "query_start_loc": torch.tensor(starts, **i32),
            "seq_lens": torch.tensor([c + q for c, q in zip(context_lens, query_lens)], **i32),
            "context_lens": torch.tensor(context_lens, **i32),
            "page_table": torch.tensor([p + [0] * (width - len(p)) for p in tables], **i32).reshape(len(tables), width),
            "slot_mapping": torch.tensor(slots, **i64), "logits_indices": torch.tensor(logits_indices, **i64)}


def random_batch(rng: random.Random):
    """Decode-only steps, prefills, chunks after a cached prefix; spare pages; any logits rows. Some
    decodes are NUMPY_DECODE_SLOTS or more sequences, whose slots numpy computes."""
    b = rng.choice([rng.randint(1, 9), rng.randint(NUMPY_DECODE_SLOTS - 2, NUMPY_DECODE_SLOTS + 20)])
    page = rng.choice([1, 4, 16])
    decode = rng.random() < 0.4
    query_lens = [1 if decode else rng.randint(1, 40) for _ in range(b)]
    context_lens = [rng.randint(0, 90) for _ in range(b)]
    pages = rng.sample(range(1, 50000), 10000)
    tables = [[pages.pop() for _ in range(-(-(c + q) // page) + rng.randint(0, 3))]
              for c, q in zip(context_lens, query_lens)]
    t = sum(query_lens)
    ids = [rng.randrange(50000) for _ in range(t)]
    logits = sorted(rng.sample(range(t), rng.randint(0, t)))
    return ids, query_lens, context_lens, tables, page, logits


def assert_matches(batch: ForwardBatch, want: dict[str, torch.Tensor], spec) -> None:
    for name in FIELDS:
        got = getattr(batch, name)
        assert got.dtype == want[name].dtype and got.shape == want[name].shape, name
        assert torch.equal(got.cpu(), want[name]), name
    ids, query_lens, context_lens, _, _, _ = spec
    assert batch.query_lens_cpu == query_lens and batch.context_lens_cpu == context_lens
    assert batch.seq_lens_cpu == want["seq_lens"].tolist()


def test_build_matches_the_per_token_reference(seed):
    rng = random.Random(seed)
    for _ in range(200):
        spec = random_batch(rng)
        batch = ForwardBatch.build(*spec)
        assert_matches(batch, reference(*spec), spec)
        assert batch.uniform_query_len == (spec[1][0] if len(set(spec[1])) == 1 else None)
        for name in FIELDS:  # every field starts on ALIGN bytes, as separate allocations did
            assert getattr(batch, name).data_ptr() % ALIGN == 0, name


def test_cpu_batches_do_not_share_a_buffer(seed):
    """On the CPU a batch is a view of its host buffer: the next batch must not write into it."""
    rng = random.Random(seed)
    staging = HostStaging("cpu")
    specs = [random_batch(rng) for _ in range(10)]
    built = [ForwardBatch.build(*spec, staging=staging) for spec in specs]
    for spec, batch in zip(specs, built):
        assert_matches(batch, reference(*spec), spec)


@pytest.mark.gpu
def test_reused_pinned_buffer_waits_for_the_copy_in_flight(seed):
    """Each copy is queued behind device work, so a host that wrote the next batch into the pinned
    buffer without waiting would send a later batch's numbers in an earlier batch's copy."""
    rng = random.Random(seed)
    staging = HostStaging("cuda")
    assert staging.pinned
    busy, out = torch.randn(4096, 4096, device="cuda"), torch.empty(4096, 4096, device="cuda")
    specs = [random_batch(rng) for _ in range(24)]
    built = []
    for spec in specs:
        for _ in range(8):
            torch.mm(busy, busy, out=out)
        built.append(ForwardBatch.build(*spec, device="cuda", staging=staging))
    buffers = {b.input_ids.untyped_storage().data_ptr() for b in built}
    assert len(buffers) == len(built)  # each batch its own device buffer; the host one is shared
    for spec, batch in zip(specs, built):
        assert batch.page_table.is_cuda
        assert_matches(batch, reference(*spec), spec)
