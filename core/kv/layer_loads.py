"""Pages loaded from host memory, written into the KV cache layer by layer beside the forward.

A hit in host memory (hierarchy.py) stages its records here when the scheduler matches it; the
runner starts the copies as the step's forward begins, and each layer's attention waits for its
own layer only, so layer N computes while N+1 still loads. On CUDA the copies run on a stream of
their own, one event recorded after each layer's; ``KVCache.layer(i)``, which every model asks
for layer i's arrays before it reads them, makes the compute stream wait on event i. Elsewhere
(the CPU) the same path applies layer i's copies when ``layer(i)`` is asked: synchronous, and
a model that read a layer without asking would read it unloaded, so the CPU tests check the waits.

Anything else that reads or writes these pages (a record read for a lower tier, a page copy, a
captured graph's replay) applies every staged copy first, in order on the compute stream.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class _Load:
    idx: torch.Tensor  # the pages, on the device
    layers: dict[int, torch.Tensor]  # per KV layer: its [pages, bytes] columns of the records (pinned on CUDA)


class LayerLoads:
    def __init__(self, device: torch.device, layer_columns: dict[int, list[tuple[torch.Tensor, int, int]]]) -> None:
        """``layer_columns``: per KV layer, its [pages, bytes] arrays (K, V) and where each one's bytes
        lie in a record (offset, width)."""
        self.device = device
        self.columns = layer_columns
        self._cuda = device.type == "cuda"
        self._staged: list[_Load] = []
        self._started: list[_Load] = []
        self._done: set[int] = set()  # layers applied (CPU) or waited for (CUDA) in this forward
        self._events: dict[int, torch.cuda.Event] = {}
        self._stream: torch.cuda.Stream | None = None
        self.layer_copies = 0  # layer-by-layer copies made since start-up (tests and benchmarks read it)

    @property
    def staged(self) -> bool:
        return bool(self._staged)

    def stage(self, idx: torch.Tensor, records: torch.Tensor) -> None:
        """Pages ``idx`` get ``records`` ([pages, record bytes] on the host) when the forward reaches them."""
        layers = {}
        for layer, cols in self.columns.items():
            first, last = cols[0][1], cols[-1][1] + cols[-1][2]
            part = records[:, first:last]
            if self._cuda:  # one contiguous pinned block per layer: a copy that runs beside the compute
                part = torch.empty(part.shape, dtype=torch.uint8, pin_memory=True).copy_(part)
            layers[layer] = part
        self._staged.append(_Load(idx, layers))

    def start(self) -> None:
        """The forward begins: on CUDA queue every layer's copies on the copy stream, in layer order,
        behind the work queued so far (the pages may have been read by a step still running)."""
        if not self._staged:
            return
        self.finish()  # a forward's copies still under way land first
        self._started, self._staged = self._staged, []
        self._done.clear()
        if not self._cuda:
            return
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        for load in self._started:  # made on the compute stream, read on this one
            load.idx.record_stream(self._stream)
        with torch.cuda.stream(self._stream):
            for layer in sorted(self.columns):
                self._copy(layer)
                self._events[layer] = torch.cuda.Event()
                self._events[layer].record(self._stream)

    def wait(self, layer: int) -> None:
        """Layer ``layer``'s arrays are about to be read: its pages must be in."""
        if self._staged:  # read outside a forward: everything, now
            self.flush()
        if not self._started or layer in self._done or layer not in self.columns:
            return
        self._done.add(layer)
        if self._cuda:
            torch.cuda.current_stream(self.device).wait_event(self._events[layer])
        else:
            self._copy(layer)

    def finish(self) -> None:
        """The forward is queued: the compute stream waits for every copy (or the CPU makes those no
        layer asked for), so nothing after it sees a page half loaded."""
        if not self._started:
            return
        if self._cuda:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)
        else:
            for layer in sorted(self.columns):
                if layer not in self._done:
                    self._copy(layer)
        self._started, self._events = [], {}
        self._done.clear()

    def flush(self) -> None:
        """Apply every staged copy now (on CUDA: the current stream waits for them)."""
        self.start()
        self.finish()

    def _copy(self, layer: int) -> None:
        for load in self._started:
            data = load.layers[layer].to(self.device, non_blocking=True)
            at = self.columns[layer][0][1]
            for rows, offset, width in self.columns[layer]:
                rows.index_copy_(0, load.idx, data[:, offset - at:offset - at + width])
        self.layer_copies += 1
