"""Pages loaded from host memory reach each layer only when the forward asks for that layer
(layer_loads.py): on the CPU the copies of layer i are made when ``layer(i)`` is asked, so a
model that read a layer without asking would read it unloaded; anything else that reads the
pages, or the end of the forward, applies every staged copy first. On CUDA the same path runs on
a copy stream with an event per layer (tests/core/test_hicache.py's gpu test)."""

from __future__ import annotations

import contextlib
import random

import torch

from engine.core.kv.storage import KVCache, KVLayerSpec

FP8 = torch.float8_e4m3fn
LAYERS = [KVLayerSpec(2, 8, 8), KVLayerSpec(1, 16, 0), KVLayerSpec(1, 8, 8, windowed=True),
          KVLayerSpec(1, 16, 1, rate=4, k_dtype=FP8, v_dtype=torch.float32), KVLayerSpec(4, 4, 6)]


def cache() -> KVCache:
    kv = KVCache(LAYERS, num_pages=9, page_size=4, dtype=torch.float32, device="cpu", num_window_pages=3)
    for i in range(kv.num_layers):
        for t in (kv._layers[i].k, kv._layers[i].v):
            t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8))
    return kv


def raw(kv: KVCache, i: int, pages: list[int]) -> list[torch.Tensor]:
    """Layer ``i``'s bytes of ``pages`` as they are now, without asking for the layer."""
    return [t.view(torch.uint8)[pages].clone() for t in (kv._layers[i].k, kv._layers[i].v)]


def test_each_layer_is_loaded_when_the_forward_asks_for_it(seed):
    rng = random.Random(seed)
    source, kv = cache(), cache()
    src, dst = rng.sample(range(1, 9), 3), rng.sample(range(1, 9), 3)
    records = source.read_records(src)
    loaded = [i for i, s in enumerate(LAYERS) if not s.windowed]
    old = {i: raw(kv, i, dst) for i in loaded}
    want = {i: raw(source, i, src) for i in loaded}
    windowed = [raw(kv, i, list(range(3))) for i, s in enumerate(LAYERS) if s.windowed]
    assert sorted(kv.loads.columns) == loaded
    kv.write_records(dst, records)
    assert kv.loads.staged and all(torch.equal(a, b) for i in loaded for a, b in zip(raw(kv, i, dst), old[i]))

    kv.loads.start()  # the forward begins
    order = rng.sample(loaded, len(loaded))
    asked = set()
    for i in order[:-1]:
        kv.layer(i)
        asked.add(i)
        for j in loaded:
            expect = want[j] if j in asked else old[j]
            assert all(torch.equal(a, b) for a, b in zip(raw(kv, j, dst), expect)), (j, asked)
    kv.loads.finish()  # the layer no one asked for lands too
    for i in loaded:
        assert all(torch.equal(a, b) for a, b in zip(raw(kv, i, dst), want[i]))
    after = [raw(kv, i, list(range(3))) for i, s in enumerate(LAYERS) if s.windowed]
    assert all(torch.equal(a, b) for x, y in zip(after, windowed) for a, b in zip(x, y))  # window records travel apart
    assert kv.loads.layer_copies == len(loaded) and not kv.loads.staged


def test_a_read_outside_the_forward_applies_every_staged_copy(seed):
    rng = random.Random(seed)
    source, kv = cache(), cache()
    src, dst = rng.sample(range(1, 9), 2), rng.sample(range(1, 9), 2)
    kv.write_records(dst, source.read_records(src))
    assert torch.equal(kv.read_records(dst), source.read_records(src))
    assert not kv.loads.staged
    kv.write_records(dst[:1], source.read_records(src[1:]))
    kv.layer(rng.choice(list(kv.loads.columns)))  # asked with no forward under way: everything lands
    assert torch.equal(kv.read_records(dst[:1]), source.read_records(src[1:]))


class _Stream:
    def __init__(self, log: list, name: str = "copy") -> None:
        self.log, self.name = log, name

    def wait_stream(self, other: "_Stream") -> None:
        self.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event) -> None:
        self.log.append(("wait_event", self.name, event.layer))


def test_the_cuda_path_orders_copies_and_waits_per_layer(monkeypatch, seed):
    """The CUDA control flow with stand-in streams and events (the copies themselves run on the CPU):
    the copy stream waits for the compute stream, one event per layer in layer order, each layer's
    first read waits on its event once, the end of the forward on the copy stream; nothing at all
    where nothing was staged."""
    rng = random.Random(seed)
    log: list = []
    compute = _Stream(log, "compute")
    current = [compute]

    class Event:
        def record(self, stream):
            self.layer = len([e for e in log if e[0] == "record"])
            log.append(("record", stream.name, current[-1].name))

    @contextlib.contextmanager
    def on(stream):
        current.append(stream)
        yield
        current.pop()

    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **k: empty(*a, **k))
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: log.append(("record_stream", stream.name)))
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: _Stream(log))
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[-1])
    monkeypatch.setattr(torch.cuda, "stream", on)
    source, kv = cache(), cache()
    kv.loads._cuda = True
    kv.loads.flush()
    kv.layer(0)
    assert log == []  # nothing staged: no stream touched
    src, dst = rng.sample(range(1, 9), 3), rng.sample(range(1, 9), 3)
    kv.write_records(dst, source.read_records(src))
    kv.loads.start()
    loaded = sorted(kv.loads.columns)
    assert log == [("wait_stream", "copy", "compute"), ("record_stream", "copy")] + \
        [("record", "copy", "copy")] * len(loaded)
    log.clear()
    order = rng.sample(loaded, len(loaded))
    for i in order + order[:1]:
        kv.layer(i)
    assert log == [("wait_event", "compute", loaded.index(i)) for i in order]
    log.clear()
    kv.loads.finish()
    assert log == [("wait_stream", "compute", "copy")]
    for i in loaded:
        assert all(torch.equal(a, b) for a, b in zip(raw(kv, i, dst), raw(source, i, src)))
