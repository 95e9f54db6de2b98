"""A write to a lower tier copies its pages to the host behind the step that wrote them
(core/kv/host_copy.py): the copy is what the pages held when it was asked for, even where later
work overwrites the pages at once; on CUDA the host does not wait for the device to ask for it."""

from __future__ import annotations

import random
import time

import pytest
import torch

from engine.core.kv.storage import KVCache, KVLayerSpec

LAYERS = [KVLayerSpec(2, 8, 8), KVLayerSpec(1, 16, 0), KVLayerSpec(1, 8, 8, windowed=True)]


def cache(device: str) -> KVCache:
    kv = KVCache(LAYERS, num_pages=9, page_size=4, dtype=torch.float32, device=device, num_window_pages=3)
    for layer in kv._layers:
        for t in (layer.k, layer.v):
            t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8))
    return kv


def overwrite(kv: KVCache, pages: list[int]) -> None:
    """Later work reusing ``pages`` (queued on the device's stream)."""
    for spec, layer in zip(kv.specs, kv._layers):
        for t in (layer.k, layer.v) if not spec.windowed else ():
            t[pages] = -1.0


def test_a_copy_is_what_the_pages_held_when_asked_for(seed):
    rng = random.Random(seed)
    kv = cache("cpu")
    pages = rng.sample(range(1, 9), 3)
    expected = kv.read_records(pages)
    copy = kv.copy_records(pages)
    overwrite(kv, pages)
    assert copy.ready() and torch.equal(copy.wait(), expected) and not torch.equal(kv.read_records(pages), expected)


@pytest.mark.gpu
def test_on_cuda_the_copy_is_queued_behind_the_step_and_the_host_does_not_wait(seed):
    rng = random.Random(seed)
    kv = cache("cuda")
    pages = rng.sample(range(1, 9), 3)
    expected = kv.read_records(pages)
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # a long step still running on the stream (about a second)
    started = time.monotonic()
    copy = kv.copy_records(pages)
    asked = time.monotonic() - started
    overwrite(kv, pages)  # the next step reuses the pages at once
    assert not copy.ready() and asked < 0.2
    got = copy.wait()
    assert got.is_pinned() and torch.equal(got, expected) and not torch.equal(kv.read_records(pages), expected)
