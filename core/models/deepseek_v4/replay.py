"""DeepSeek-V4.1's encoder/decoder split and SWA bounded replay.

From the last KV source on, every layer of V4.1 reads that source's shared entries (and index
keys): those layers are the decoder, the ones before it the encoder (V4.1-Flash: layers 0-19 and
20-39). A prefill with the replay runs the encoder over every prompt token; the decoder's source
layer writes its shared entries for the tokens before the last ``sliding_window`` of the prompt
from the encoder output (its own input), and the decoder layers run only over that last window
(the replayed rows). Their window KV below the replay's first position is never written, so a
replayed query sees only window keys from that position on (``ForwardBatch.window_floors_cpu``):
the earliest replayed tokens see a truncated window, which is why the replay approximates a full
prefill. Decode steps and any chunk after the floor run every layer on every row.

Per sequence the floor is ``max(0, length - sliding_window)`` of its whole prompt (the runner
passes each sequence's length, ``ForwardBatch.prompt_ends_cpu``), so chunked prefill cut anywhere
gives the one-chunk replay: a chunk before the floor runs no decoder layer, one across it runs them
on its part from the floor on. A prefix hit leaves the last ``sliding_window`` prompt tokens to
compute (``CausalLM.replay_tail``), so the decoder never reads window KV that another sequence's
replay left unwritten.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from ...forward import ForwardBatch
from ...kv.storage import KVCache


def decoder_split(hf: dict, backend: Any) -> int:
    """The first decoder layer of a normalised V4 config: the last of ``kv_source_layer_ids``, whose
    entries every later layer reads. A ValueError says why a checkpoint (or the V4 attention
    ``backend``) has no split to replay."""
    flag = "enable_swa_bounded_replay"
    sources = hf.get("kv_source_layer_ids") or []
    if not sources:
        raise ValueError(f"{flag}: the checkpoint names no kv_source_layer_ids (a DeepSeek-V4, not a V4.1): no "
                         f"layer's shared KV serves the layers after it, so it has no encoder/decoder split")
    split, roles = sources[-1], hf["csa2_roles"]
    if split == 0:
        raise ValueError(f"{flag}: the last KV source is layer 0, so there is no encoder before the decoder")
    for layer in range(split, len(roles)):
        if roles[layer] is None or roles[layer].kv_source != split:
            raise ValueError(f"{flag}: layer {layer} after the last KV source (layer {split} of kv_source_layer_ids) "
                             f"does not read its shared entries, so layers {split}.. are no decoder it serves")
    engram = [layer for layer in hf.get("engram_layer_ids") or [] if layer >= split]
    if engram:
        raise ValueError(f"{flag}: engram_layer_ids {engram} are decoder layers (from layer {split}); a replay of "
                         f"Engram in the decoder is not supported")
    if not backend.window_floors:
        raise ValueError(f"{flag}: the {backend.name} V4 attention backend cannot hide the window keys below a "
                         f"replay's first position (V4AttentionBackend.window_floors)")
    return split


def _part(batch: ForwardBatch, lo: list[int], hi: list[int]) -> tuple[torch.Tensor, ForwardBatch]:
    """The rows of ``batch`` at positions lo[i]..hi[i] - 1 of each sequence i (inside its step), and
    a batch of just those (each sequence's context up to lo[i]; logits rows kept where inside)."""
    rows, start = [], 0
    for c, q, a, b in zip(batch.context_lens_cpu, batch.query_lens_cpu, lo, hi):
        rows.extend(range(start + a - c, start + b - c))
        start += q
    device = batch.input_ids.device
    index = torch.tensor(rows, dtype=torch.long, device=device)
    where = {row: i for i, row in enumerate(rows)}
    logits = [where[r] for r in batch.logits_indices.tolist() if r in where]
    query = [b - a for a, b in zip(lo, hi)]
    loc = torch.tensor([0] + query, dtype=torch.int32, device=device).cumsum(0, dtype=torch.int32)
    part = ForwardBatch(batch.input_ids[index], batch.positions[index], loc,
                        torch.tensor(hi, dtype=torch.int32, device=device),
                        torch.tensor(lo, dtype=torch.int32, device=device), batch.page_table,
                        batch.slot_mapping[index], torch.tensor(logits, dtype=torch.long, device=device),
                        batch.page_size, query_lens_cpu=query, seq_lens_cpu=list(hi), context_lens_cpu=list(lo))
    return index, part


@dataclass
class ReplayPlan:
    """One step's replay: which rows skip the decoder, which run it, and below which position each
    sequence's decoder queries see no window keys."""

    split: int
    skipped: tuple[torch.Tensor, ForwardBatch] | None  # rows before the floor: the source's entries only
    replayed: tuple[torch.Tensor, ForwardBatch]  # rows from the floor on, with the floors set
    num_tokens: int

    @classmethod
    def of(cls, batch: ForwardBatch, split: int, tail: int) -> "ReplayPlan | None":
        """The plan of ``batch``; None where no row's window reaches below its sequence's floor (decode
        steps, prompts inside the window): every row runs as it would without the replay."""
        steps = list(zip(batch.context_lens_cpu, batch.seq_lens_cpu))
        ends = batch.prompt_ends_cpu or [end for _, end in steps]
        floors = [max(0, end - tail) for end in ends]
        if all(not f or c >= f + tail - 1 for (c, _), f in zip(steps, floors)):
            return None
        if batch.features is not None:
            raise ValueError("enable_swa_bounded_replay: the step asks for per-token features of every row, and "
                             "the replay runs the decoder layers over the last window of the prompt only")
        firsts = [min(max(c, f), end) for (c, end), f in zip(steps, floors)]
        skipped = None
        if any(first > c for (c, _), first in zip(steps, firsts)):
            skipped = _part(batch, [c for c, _ in steps], firsts)
            if skipped[1].logits_indices.numel():
                raise ValueError("enable_swa_bounded_replay: the step asks for the logits of prompt positions "
                                 "before the replayed window (prompt logprobs), which skip the decoder layers")
        index, part = _part(batch, firsts, [end for _, end in steps])
        return cls(split, skipped, (index, replace(part, window_floors_cpu=floors)), batch.num_tokens)

    def enter(self, state: Any, layer: Any, kv: KVCache, attention: Any) -> tuple[Any, ForwardBatch, Any]:
        """At the first decoder layer: its shared entries of the skipped rows written from their
        input, then the streams, batch and attention metadata of the replayed rows."""
        if self.skipped is not None:
            rows, batch = self.skipped
            x, _ = layer.enter_attention(_rows(state, rows))
            layer.attn.write_shared(x, batch, kv, attention.prepare(batch, kv))
        rows, batch = self.replayed
        return _rows(state, rows), batch, attention.prepare(batch, kv)

    def restore(self, hidden: torch.Tensor) -> torch.Tensor:
        """The decoder's output over the replayed rows, at their rows of the step (NaN elsewhere: those
        rows have no output, and the plan refused any logits of theirs)."""
        if self.skipped is None:
            return hidden
        out = hidden.new_full((self.num_tokens, *hidden.shape[1:]), float("nan"))
        return out.index_copy_(0, self.replayed[0], hidden)


def _rows(state: Any, rows: torch.Tensor) -> Any:
    """The residual streams (model.Streams) of ``rows`` only."""
    return type(state)(*(None if t is None else t[rows] for t in state))
