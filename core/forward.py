"""The forward batch: everything one model step needs, passed explicitly to every layer.

Tokens of all sequences in a step are packed into one flat axis (varlen). Sequence ``i`` brings
``query_lens[i]`` new tokens at positions ``context_lens[i] .. seq_lens[i]-1``; the KV of
positions below ``context_lens[i]`` is already in its pages (a cached prefix or earlier chunks).

Every integer array of a batch is assembled in one host buffer (``BatchLayout`` says where each
lies) and reaches the device in one copy; the batch's tensors are views of that one device buffer.
Each small array copied on its own would cost a launch and a host wait per step.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Union

import numpy as np
import torch

ALIGN = 16  # bytes: where each array starts, the pointer alignment Triton specializes kernels on


_FIELDS64 = ("input_ids", "positions", "slot_mapping", "logits_indices")
_FIELDS32 = ("query_start_loc", "seq_lens", "context_lens", "page_table")  # the table last: see BatchLayout


@dataclass(frozen=True)
class BatchLayout:
    """Where each array of a batch lies in one packed byte buffer: the int64 arrays, then the int32
    ones, each on ``ALIGN`` bytes. The page table comes last, so every other array's place depends
    on the batch's sizes alone and not on the table's width."""

    num_seqs: int
    width: int  # page-table columns
    chunks64: tuple[int, ...]  # the int64 part in elements: each field, then its padding to ALIGN
    chunks32: tuple[int, ...]  # the same for the int32 part, which starts at byte ``bytes64``
    bytes64: int
    nbytes: int

    def views(self, buf: torch.Tensor | np.ndarray) -> dict[str, Any]:
        """Typed views of every field in ``buf``, a uint8 tensor (device side) or numpy array (host side)."""
        head, tail = buf[:self.bytes64], buf[self.bytes64:self.nbytes]
        if isinstance(buf, np.ndarray):
            parts64, parts32 = _split(head.view(np.int64), self.chunks64), _split(tail.view(np.int32), self.chunks32)
        else:  # one call per part: a torch slice each would cost microseconds of host time per field
            parts64 = head.view(torch.int64).split_with_sizes(self.chunks64)[::2]
            parts32 = tail.view(torch.int32).split_with_sizes(self.chunks32)[::2]
        out = dict(zip(_FIELDS64, parts64))
        out.update(zip(_FIELDS32, parts32))
        out["page_table"] = out["page_table"].reshape(self.num_seqs, self.width)
        return out


def _split(a: np.ndarray, chunks: tuple[int, ...]) -> list[np.ndarray]:
    out, at = [], 0
    for n, pad in zip(chunks[::2], chunks[1::2]):
        out.append(a[at:at + n])
        at += n + pad
    return out


def _chunks(counts: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    step = ALIGN // itemsize
    return tuple(c for n in counts for c in (n, -n % step))


@functools.lru_cache(maxsize=1024)
def batch_layout(num_tokens: int, num_seqs: int, num_logits: int, width: int) -> BatchLayout:
    """The layout of a batch of these sizes (a decode step's repeats, so it is made once)."""
    c64 = _chunks((num_tokens, num_tokens, num_tokens, num_logits), 8)
    c32 = _chunks((num_seqs + 1, num_seqs, num_seqs, num_seqs * width), 4)
    return BatchLayout(num_seqs, width, c64, c32, 8 * sum(c64), 8 * sum(c64) + 4 * sum(c32))


PageTables = Union[list[list[int]], np.ndarray]  # per sequence its pages, or rows of an [n, width] int32 array


def page_table_array(page_tables: PageTables) -> np.ndarray:
    """Page tables as an [n, width] int32 array, padded with 0 (a list's width: its longest table, at least 1)."""
    if isinstance(page_tables, np.ndarray):
        return page_tables
    table = np.zeros((len(page_tables), max(map(len, page_tables), default=0) or 1), dtype=np.int32)
    for row, pages in zip(table, page_tables):
        row[:len(pages)] = pages
    return table


NUMPY_DECODE_SLOTS = 32  # from this many sequences on, decode slots are computed by numpy


def _decode_slots(out: np.ndarray, table: np.ndarray, ctx: np.ndarray, context_lens: list[int], page_size: int) -> None:
    """Where each sequence's one new token goes: its page (``table`` row, column ctx // page_size)
    times the page size, plus its offset in the page. numpy does it in a few calls whatever the
    batch, but each costs microseconds between a step's other work; Python's loop costs a fraction
    of a microsecond a row, so it is the cheaper below ``NUMPY_DECODE_SLOTS`` rows."""
    if len(context_lens) < NUMPY_DECODE_SLOTS:
        out[:] = [row[c // page_size] * page_size + c % page_size for row, c in zip(table.tolist(), context_lens)]
        return
    page, offset = np.divmod(ctx, page_size)
    np.multiply(table[np.arange(len(context_lens)), page], page_size, out=out)
    out += offset


def pack_batch(v: dict[str, np.ndarray], input_ids: list[int], query_lens: list[int], context_lens: list[int],
               page_table: np.ndarray, page_size: int, logits_indices) -> None:
    """Fill the host views ``v`` of a layout with a batch; ``page_table`` is [num_seqs, width] (its
    padding is 0 and never read), or fewer rows, the rest padding rows of zeros."""
    num_seqs, num_tokens = len(query_lens), len(input_ids)
    ctx, starts, pos, slots = v["context_lens"], v["query_start_loc"], v["positions"], v["slot_mapping"]
    v["input_ids"][:] = input_ids
    v["logits_indices"][:] = logits_indices
    ctx[:] = context_lens
    table = v["page_table"]
    table[:len(page_table)] = page_table
    if len(page_table) < num_seqs:
        table[len(page_table):] = 0
    if num_tokens == num_seqs and query_lens.count(1) == num_seqs:  # decode: one token each, at its context length
        starts[:] = np.arange(num_seqs + 1)
        np.add(ctx, 1, out=v["seq_lens"])
        pos[:] = ctx
        _decode_slots(slots, table, ctx, context_lens, page_size)
        return
    starts[0] = 0
    np.cumsum(query_lens, out=starts[1:])
    np.add(ctx, query_lens, out=v["seq_lens"])
    owner = np.repeat(np.arange(num_seqs), query_lens)  # the sequence of each token
    np.add((ctx - starts[:-1])[owner], np.arange(num_tokens), out=pos)
    slots[:] = table[owner, pos // page_size]
    slots *= page_size
    slots += pos % page_size


class HostStaging:
    """The host side of a batch's one copy to the device: a buffer kept and reused step after step.

    On CUDA it is pinned, so the copy runs asynchronously; before writing it again the host waits
    for the event recorded after the last copy out of it (a step that overwrote it while that copy
    was in flight would send a torn batch). Elsewhere the copy is done when ``send`` returns.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.pinned = self.device.type == "cuda"
        self._buf: torch.Tensor | None = None
        self._copied = torch.cuda.Event() if self.pinned else None

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 host buffer of ``nbytes`` that no copy in flight still reads."""
        if self.pinned:
            self._copied.synchronize()
        if self._buf is None or self._buf.numel() < nbytes:
            size = max(nbytes, 2 * self._buf.numel() if self._buf is not None else 1 << 16)
            self._buf = torch.empty(size, dtype=torch.uint8, pin_memory=self.pinned)
        return self._buf[:nbytes]

    def send(self, host: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Copy ``host`` (from ``take``) into ``out`` on the device, or into a new device tensor."""
        out = torch.empty_like(host, device=self.device) if out is None else out
        out.copy_(host, non_blocking=self.pinned)
        if self.pinned:
            self._copied.record(torch.cuda.current_stream(self.device))  # the stream the copy went on
        return out


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64, new tokens of every sequence, packed
    positions: torch.Tensor  # [T] int64, absolute position of each new token
    query_start_loc: torch.Tensor  # [B+1] int32, offsets of each sequence's tokens in the packed axis
    seq_lens: torch.Tensor  # [B] int32, KV length of each sequence after this step
    context_lens: torch.Tensor  # [B] int32, KV length already cached before this step
    page_table: torch.Tensor  # [B, max_pages] int32, page ids (padding is 0 and never read)
    slot_mapping: torch.Tensor  # [T] int64, page_id * page_size + offset where each new token's KV goes
    logits_indices: torch.Tensor  # [N] int64, packed-token rows whose logits are needed
    page_size: int
    # host copies, so backends and models need no device sync to read the shape of the batch
    query_lens_cpu: list[int] = field(default_factory=list)
    seq_lens_cpu: list[int] = field(default_factory=list)
    context_lens_cpu: list[int] = field(default_factory=list)
    attn_metadata: Any = None  # filled once per step by the attention backend's ``prepare``
    # where the runner asks for them (speculative decoding's MTP): the model puts per-token features
    # here by name (DeepSeek-V4: "streams", its residual streams before the head)
    features: dict[str, torch.Tensor] | None = None
    # with features: the layers whose outputs the model puts in features["layers"], one after
    # another per token (CausalLM.layer_feature_size wide each; what a DSpark drafter reads)
    feature_layers: tuple[int, ...] = ()
    # per sequence, the length it is prefilled to (where the model's ``replay_tail`` asks; empty: each
    # sequence's step ends it), and the first position whose window KV a query may read (empty: 0)
    prompt_ends_cpu: list[int] = field(default_factory=list)
    window_floors_cpu: list[int] = field(default_factory=list)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def uniform_query_len(self) -> int | None:
        """The number of new tokens every sequence brings, where all bring the same (decode steps,
        and the verify steps of speculative decoding: the last token and K drafts each); else None."""
        lens = set(self.query_lens_cpu)
        return lens.pop() if len(lens) == 1 else None

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens_cpu, default=0)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_cpu, default=0)

    @classmethod
    def build(
        cls,
        input_ids: list[int],
        query_lens: list[int],
        context_lens: list[int],
        page_tables: PageTables,
        page_size: int,
        logits_indices: list[int],
        device: torch.device | str = "cpu",
        staging: HostStaging | None = None,
    ) -> "ForwardBatch":
        """Build a batch from host lists (the runner's path, with its reused ``staging``; tests too)."""
        staging = staging or HostStaging(device)
        table = page_table_array(page_tables)
        layout = batch_layout(len(input_ids), len(query_lens), len(logits_indices), table.shape[1])
        host = staging.take(layout.nbytes)
        pack_batch(layout.views(host.numpy()), input_ids, query_lens, context_lens, table, page_size,
                   logits_indices)
        v = layout.views(staging.send(host))
        return cls(**v, page_size=page_size, query_lens_cpu=list(query_lens),
                   seq_lens_cpu=[c + q for c, q in zip(context_lens, query_lens)], context_lens_cpu=list(context_lens))
