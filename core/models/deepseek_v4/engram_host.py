"""DeepSeek-V4.1's Engram tables in host memory (``--engram-placement host``): a step's rows found
from its token ids on the host, gathered there and copied to the device before the layers run.

V4.1-Flash's two tables hold about 384M rows of 256 each (98 GB a layer in FP8), while a token
reads only (N - 1) x K rows a layer (24 there). The rows depend on token ids alone, so the host
finds them when the step is formed: each token's compressed id and those of the N - 1 tokens
before it (the runner passes each sequence's N - 1 ids before its step, so a chunk, a prefix hit
or a recomputed sequence finds the n-grams a whole prefill would), hashed by core/native/engram.py.
Each Engram layer registers under its layer id (``register``) and owns static device buffers that
its rows land in, so a captured graph reads, at each layer, that layer's rows and no other's.

On CUDA the tables are pinned, each layer's rows are gathered into a pinned staging buffer and
copied on a side stream behind the step queued before (whose layers may still read the buffers);
the layer waits for its copy's event (an external one, so that a captured graph waits on the
copy made before its replay): the copies run while the layers before it compute. Without
``prefetch`` the copies go on the step's own stream, before its first layer. Elsewhere the rows
are gathered straight into the buffers.
"""

from __future__ import annotations

import numpy as np
import torch

from ...native.engram import ngram_rows
from .engram import EngramLayout, EngramTable, Rows

MIN_BUFFER_TOKENS = 256  # the static buffers' least capacity: a decode step of up to this many sequences


class _LayerRows:
    """One Engram layer's table on the host and the device buffers its step's rows land in."""

    def __init__(self, table: Rows, hashing: EngramTable, width: int, device: torch.device) -> None:
        self.table, self.hashing, self.width, self.device = table, hashing, width, device
        self.static: tuple[torch.Tensor, ...] = ()  # stored rows [tokens, width, ...] (and scales): graphs read these
        self.overflow: tuple[torch.Tensor, ...] = ()  # the same for an eager step past their capacity
        self.staging: tuple[torch.Tensor, ...] = ()  # pinned host buffers the rows are gathered into (CUDA)
        cuda = device.type == "cuda"
        self.copied = torch.cuda.Event(external=True) if cuda else None
        if cuda:  # made now: a graph captured before the first step waits on it all the same
            self.copied.record(torch.cuda.current_stream(device))

    def stored(self) -> tuple[torch.Tensor, ...]:
        """The table as stored: rows (E4M3 ones as bytes: no E4M3 gather on the CPU) and their scales."""
        w = self.table.weight
        if self.table.weight_scale is None:
            return (w,)
        return w.view(torch.uint8), self.table.weight_scale

    def _empty(self, tokens: int, device, pinned: bool = False) -> tuple[torch.Tensor, ...]:
        return tuple(torch.zeros((tokens, self.width, *t.shape[1:]), dtype=t.dtype, device=device,
                                 pin_memory=pinned) for t in self.stored())

    def buffers(self, tokens: int) -> tuple[torch.Tensor, ...]:
        """Where ``tokens`` tokens' rows land: the static buffers (made at the first step, for at least
        ``MIN_BUFFER_TOKENS``: a graph's steps are never larger than the first step it is captured
        at) or, past them, overflow buffers grown as needed."""
        if not self.static:
            self.static = self._empty(max(tokens, MIN_BUFFER_TOKENS), self.device)
        if tokens <= self.static[0].shape[0]:
            return tuple(b[:tokens] for b in self.static)
        if not self.overflow or self.overflow[0].shape[0] < tokens:
            self.overflow = self._empty(tokens, self.device)
        return tuple(b[:tokens] for b in self.overflow)

    def stage(self, ngram_ids: torch.Tensor, stream) -> None:
        """Gather the rows of ``ngram_ids`` [T, N] and copy them into the device buffers on ``stream``."""
        h = self.hashing
        rows = ngram_rows(ngram_ids, h.multipliers, h.primes, h.offsets).flatten()
        tokens = ngram_ids.shape[0]
        out = self.buffers(tokens)
        if self.copied is None:  # the device is the host: gathered straight into place
            for t, o in zip(self.stored(), out):
                torch.index_select(t, 0, rows, out=o.view(-1, *o.shape[2:]))
            return
        self.copied.synchronize()  # the last copy out of the staging buffers is done
        if not self.staging or self.staging[0].shape[0] < tokens:
            self.staging = self._empty(max(tokens, MIN_BUFFER_TOKENS), "cpu", pinned=True)
        staged = [s[:tokens] for s in self.staging]
        for t, s in zip(self.stored(), staged):
            torch.index_select(t, 0, rows, out=s.view(-1, *s.shape[2:]))
        with torch.cuda.stream(stream):
            for s, o in zip(staged, out):
                o.copy_(s, non_blocking=True)
            self.copied.record(stream)

    def rows(self, tokens: int) -> torch.Tensor:
        """[tokens, width, head_dim] in the model's dtype, once the copy has landed."""
        if self.copied is not None:
            torch.cuda.current_stream(self.device).wait_event(self.copied)
        return self.table.as_rows(*self.buffers(tokens))


class HostEngram:
    """Every Engram layer's table in host memory, keyed by layer id, and the step's rows on the device."""

    def __init__(self, layout: EngramLayout, device: torch.device | str, prefetch: bool = True) -> None:
        self.device = torch.device(device)
        self.table, self.pad, self.order = layout.table.cpu(), layout.pad, layout.order
        self.width = (layout.order - 1) * layout.heads
        self.layers: dict[int, _LayerRows] = {}
        self.side = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.prefetch = prefetch  # the copies on the side stream (False: on the step's stream, before it)

    @property
    def pinned(self) -> bool:
        """Whether the tables are allocated pinned (on CUDA: the copies then run asynchronously)."""
        return self.device.type == "cuda"

    def register(self, layer_id: int, table: Rows, hashing: EngramTable) -> None:
        """Layer ``layer_id``'s table (on the host) and hashing; its rows are then ``rows(layer_id, T)``."""
        if layer_id in self.layers:
            raise ValueError(f"Engram layer {layer_id} registered twice")
        self.layers[layer_id] = _LayerRows(table, hashing, self.width, self.device)

    def ngram_ids(self, input_ids: list[int], query_lens: list[int], history: list[list[int]]) -> torch.Tensor:
        """[T, N] int64: each packed token's compressed id and those of the N - 1 tokens before it,
        nearest first, pad before a sequence's start; ``history``: per sequence the N - 1 token ids
        before its step's first (-1 before its start)."""
        back = self.order - 1
        ext: list[int] = []
        at = 0
        for hist, q in zip(history, query_lens, strict=True):
            ext += hist
            ext += input_ids[at:at + q]
            at += q
        seq = np.repeat(np.arange(len(query_lens)), query_lens)
        own = np.arange(at) + back * (seq + 1)  # each token's place in ``ext``
        raw = torch.from_numpy(np.asarray(ext, dtype=np.int64)[own[:, None] - np.arange(self.order)])
        return torch.where(raw >= 0, self.table[raw.clamp_min(0)], self.pad)

    def stage(self, input_ids: list[int], query_lens: list[int], history: list[list[int]]) -> None:
        """Find, gather and send every Engram layer's rows for a step, in layer order."""
        ids = self.ngram_ids(input_ids, query_lens, history)
        layers = [self.layers[k] for k in sorted(self.layers)]
        for layer in layers:  # made (and zeroed) on the step's stream before the side stream waits for it
            layer.buffers(len(input_ids))
        stream = None
        if self.side is not None:
            stream = torch.cuda.current_stream(self.device)
            if self.prefetch:  # behind the step queued before, which may still read the buffers
                self.side.wait_stream(stream)
                stream = self.side
        for layer in layers:
            layer.stage(ids, stream)

    def rows(self, layer_id: int, num_tokens: int) -> torch.Tensor:
        """Layer ``layer_id``'s rows of the step staged last: [num_tokens, (N - 1) K, head_dim]."""
        return self.layers[layer_id].rows(num_tokens)
