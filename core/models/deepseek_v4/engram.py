"""DeepSeek-V4.1's Engram layers (conditional n-gram memory), with the tables on the device (or in
host memory: engram_host.py).

What is fixed before any weight is read, from config.json and the tokenizer (``EngramLayout``): the
tokenizer's compression table (each token's text normalised, NFKC, NFD, accents stripped, lower
case, whitespace collapsed, and equal forms given one compressed id); per Engram layer, N
multipliers (odd, from numpy's generator seeded with 10007 x the layer id, bounded so that id x
multiplier fits in int64) and the table's bucket ranges: consecutive primes from
``engram_vocab_size``, one per (order, head), layer after layer, so the ranges never share a prime
(this reproduces V4.1-Flash's ``engram_num_embeddings`` exactly).

Per step on the device (``NgramHistory``): the new tokens' compressed ids go into a windowed cache component,
one int32 per token, and each token reads back its own and the N - 1 before it, so a chunk, a
prefix hit or a recomputed sequence finds the same n-grams; positions before 0 read the pad id.
Per Engram layer (``Engram``), before its attention sublayer: the rows of its n-grams, one value
and one key per residual stream through ``wkv``, and the gated sum into each stream
(core/native/engram.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import sympy
import torch
from torch import nn

from ...forward import ForwardBatch
from ...kv.storage import KVCache
from ...native.engram import engram_gate, ngram_rows
from ...native.quant import FP8, dequantize_fp8_token_group
from ..base import Backends
from ..layers import Linear, empty_param
from .cache import flat

if TYPE_CHECKING:
    from .engram_host import HostEngram

SEED_STRIDE = 10007  # a layer's multipliers come from the generator seeded with this x its id


def compression_table(tokenizer) -> tuple[torch.Tensor, int]:
    """[vocab] int64: each token id's compressed id, and how many compressed ids there are."""
    from tokenizers import Regex, normalizers

    sentinel = "\ue000"  # keeps a lone space a space through the strip
    normal = normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), sentinel),
        normalizers.Strip(), normalizers.Replace(sentinel, " ")])
    ids: dict[str, int] = {}
    table = []
    for tid in range(tokenizer.vocab_size):
        text = tokenizer.decode([tid], skip_special_tokens=False)
        key = tokenizer.convert_ids_to_tokens(tid) if "\ufffd" in text else normal.normalize_str(text) or text
        table.append(ids.setdefault(key, len(ids)))
    return torch.tensor(table, dtype=torch.int64), len(ids)


def bucket_primes(size: int, per_layer: int, layers: int) -> list[list[int]]:
    """Each Engram layer's bucket sizes, one per (order, head): consecutive primes from ``size``
    on, never one twice."""
    primes, p = [], size - 1
    for _ in range(per_layer * layers):
        p = int(sympy.nextprime(p))
        primes.append(p)
    return [primes[i * per_layer:(i + 1) * per_layer] for i in range(layers)]


@dataclass(frozen=True)
class EngramTable:
    """One Engram layer's hashing: multipliers [N], and per (order, head) its prime and first row."""

    multipliers: torch.Tensor  # [N] int64
    primes: torch.Tensor  # [N - 1, K] int64
    offsets: torch.Tensor  # [N - 1, K] int64

    @property
    def rows(self) -> int:
        return int(self.primes.sum())


@dataclass(frozen=True)
class EngramLayout:
    table: torch.Tensor  # [vocab] int64: token id -> compressed id
    pad: int  # the compressed pad id, read before a sequence's first token
    order: int  # N: n-grams of order 2..N
    heads: int  # K per order
    head_dim: int
    layers: dict[int, EngramTable]

    @classmethod
    def from_config(cls, hf: dict, model_dir: str | Path) -> EngramLayout:
        """Refuses (naming the field) a layout that does not fit the config or the tokenizer."""
        from ...tokenizer import Tokenizer

        n_layers, layer_ids = hf["num_hidden_layers"], list(hf["engram_layer_ids"])
        for i in layer_ids:
            if not isinstance(i, int) or not 0 <= i < n_layers:
                raise ValueError(f"engram_layer_ids names layer {i!r}, out of range for {n_layers} layers")
        order, heads, size = hf.get("engram_max_ngram_size", 4), hf.get("engram_n_heads", 8), hf["engram_vocab_size"]
        if order < 2:
            raise ValueError(f"engram_max_ngram_size is {order}: Engram hashes n-grams of order 2 and up")
        tokenizer = Tokenizer.from_dir(model_dir)
        table, compressed = compression_table(tokenizer)
        if hf.get("engram_compressed_vocab_size", compressed) != compressed:
            raise ValueError(f"engram_compressed_vocab_size is {hf['engram_compressed_vocab_size']}, but the "
                             f"tokenizer in {model_dir} compresses to {compressed} ids")
        if hf["vocab_size"] > len(table):
            raise ValueError(f"vocab_size {hf['vocab_size']} exceeds the tokenizer's {len(table)} ids, which "
                             f"Engram's compression table covers")
        bound = max(1, (np.iinfo(np.int64).max // compressed) // 2)
        layers = {}
        for layer, primes in zip(layer_ids, bucket_primes(size, (order - 1) * heads, len(layer_ids))):
            draws = np.random.default_rng(SEED_STRIDE * layer).integers(0, bound, size=(order,), dtype=np.int64)
            primes_t = torch.tensor(primes, dtype=torch.int64)
            offsets = torch.cumsum(primes_t, 0) - primes_t
            layers[layer] = EngramTable(torch.from_numpy(draws * 2 + 1), primes_t.view(order - 1, heads),
                                        offsets.view(order - 1, heads))
        stated = hf.get("engram_num_embeddings")
        found = [t.rows for t in layers.values()]
        if stated is not None and list(stated) != found:
            raise ValueError(f"engram_num_embeddings {list(stated)} are not the tables' sizes {found} (primes from "
                             f"engram_vocab_size {size}, {order - 1} orders x {heads} heads a layer)")
        pad = int(table[hf.get("engram_pad_token_id", 2)])
        return cls(table, pad, order, heads, hf.get("engram_head_dim", 256), layers)


class NgramHistory(nn.Module):
    """The compressed ids of the tokens a step's n-grams reach, kept in a windowed cache component."""

    def __init__(self, layout: EngramLayout, cache_index: int, device) -> None:
        super().__init__()
        self.register_buffer("table", layout.table.to(device), persistent=False)
        self.pad, self.order, self.cache_index = layout.pad, layout.order, cache_index

    def forward(self, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        """Store the step's compressed ids, then -> [T, N] int64: each token's and the N - 1 before it."""
        ids = flat(kv, self.cache_index)[0]
        windows, ps = kv.window_table(), batch.page_size
        compressed = self.table[batch.input_ids.long()]
        own = windows[batch.slot_mapping // ps].long() * ps + batch.slot_mapping % ps
        ids.index_copy_(0, own, compressed.to(ids.dtype)[:, None])
        tokens = torch.arange(batch.num_tokens, dtype=batch.query_start_loc.dtype, device=own.device)
        seq = torch.searchsorted(batch.query_start_loc[1:], tokens, right=True)
        back = batch.positions.long()[:, None] - torch.arange(self.order, device=own.device)
        at = back.clamp_min(0)
        slots = windows[batch.page_table[seq[:, None], at // ps].long()].long() * ps + at % ps
        return torch.where(back >= 0, ids[slots, 0].long(), self.pad)


class Rows(nn.Module):
    """An Engram table: rows in the model's dtype, or kept as V4.1 publishes them (E4M3, one scale per
    ``GROUP`` of a row), each gathered row then dequantized. ``pinned``: held in pinned host memory
    (host placement on CUDA, engram_host.py)."""

    GROUP = 32

    def __init__(self, rows: int, width: int, *, dtype: torch.dtype, device, pinned: bool = False) -> None:
        super().__init__()
        self.pinned = pinned
        self.weight = self._empty(rows, width, dtype=dtype, device=device)
        self.weight_scale: torch.Tensor | None = None
        self.dtype = dtype

    def _empty(self, *shape: int, dtype: torch.dtype, device) -> nn.Parameter:
        if not self.pinned:
            return empty_param(*shape, dtype=dtype, device=device)
        return nn.Parameter(torch.empty(*shape, dtype=dtype, pin_memory=True), requires_grad=False)

    def keep_fp8(self, scale_shape: tuple[int, ...]) -> None:
        """Hold the rows as stored: E4M3 data and fp32 scales of ``scale_shape``, empty until loaded."""
        device = self.weight.device
        self.weight = self._empty(*self.weight.shape, dtype=FP8, device=device)
        self.weight_scale = self._empty(*scale_shape, dtype=torch.float32, device=device)
        self.weight_scale.values_per_element = 0  # a scale stands for no weight of its own (weights.resident_bytes)

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [...] int64 -> [..., width] in the model's dtype."""
        if self.weight_scale is None:
            return self.weight[rows]
        return self.as_rows(self.weight.view(torch.uint8)[rows], self.weight_scale[rows])

    def as_rows(self, data: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        """Gathered rows as stored (E4M3 ones as bytes, with their scales) -> the model's dtype."""
        if self.weight_scale is None:
            return data
        return dequantize_fp8_token_group(data.view(FP8), scale, self.GROUP, self.dtype)


class Engram(nn.Module):
    """One Engram layer: its table, the projection of its rows to keys and a value, the gate's weights.
    With ``host`` (host placement) the table lives in host memory and the step's rows come from there."""

    def __init__(self, hf: dict, layout: EngramLayout, layer_id: int, backends: Backends, *, dtype: torch.dtype,
                 device, host: HostEngram | None = None) -> None:
        super().__init__()
        t = layout.layers[layer_id]
        hidden, self.streams = hf["hidden_size"], hf.get("hc_mult", 4)
        self.layer_id, self.host = layer_id, host
        if host is None:
            self.embed = Rows(t.rows, layout.head_dim, dtype=dtype, device=device)
            for name in ("multipliers", "primes", "offsets"):
                self.register_buffer(name, getattr(t, name).to(device), persistent=False)
        else:
            self.embed = Rows(t.rows, layout.head_dim, dtype=dtype, device="cpu", pinned=host.pinned)
            host.register(layer_id, self.embed, t)
        self.wkv = Linear((layout.order - 1) * layout.heads * layout.head_dim, (self.streams + 1) * hidden,
                          backends.linear, dtype=dtype, device=device)
        self.q_weight = empty_param(self.streams, hidden, dtype=torch.float32, device=device)
        self.k_weight = empty_param(self.streams, hidden, dtype=torch.float32, device=device)
        self.eps = hf.get("rms_norm_eps", 1e-6)

    def forward(self, streams: torch.Tensor, ngram_ids: torch.Tensor | None) -> torch.Tensor:
        """streams [T, n, D] (every sublayer before mixed in), ngram_ids [T, N] (device placement;
        None with host placement: the rows staged for the step) -> new streams."""
        if self.host is not None:
            rows = self.host.rows(self.layer_id, streams.shape[0])
        else:
            rows = self.embed(ngram_rows(ngram_ids, self.multipliers, self.primes, self.offsets))
        kv = self.wkv(rows.flatten(1).to(streams.dtype))
        hidden = streams.shape[-1]
        keys, value = kv[:, :self.streams * hidden].view(-1, self.streams, hidden), kv[:, self.streams * hidden:]
        return engram_gate(streams, keys, value, self.q_weight, self.k_weight, self.eps)
