"""The forward batch: everything one model step needs, passed explicitly to every layer.

Tokens of all sequences in a step are packed into one flat axis (varlen). Sequence ``i`` brings
``query_lens[i]`` new tokens at positions ``context_lens[i] .. seq_lens[i]-1``; the KV of
positions below ``context_lens[i]`` is already in its pages (a cached prefix or earlier chunks).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


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
    extras: dict[str, Any] = field(default_factory=dict)  # per-family metadata of other families

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def is_decode(self) -> bool:
        """Every sequence brings exactly one new token (the shape graphs are captured for)."""
        return all(q == 1 for q in self.query_lens_cpu)

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
        page_tables: list[list[int]],
        page_size: int,
        logits_indices: list[int],
        device: torch.device | str = "cpu",
    ) -> "ForwardBatch":
        """Build a batch from host lists (the runner's path; tests use it too)."""
        seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
        width = max((len(p) for p in page_tables), default=0) or 1
        table = torch.tensor([p + [0] * (width - len(p)) for p in page_tables], dtype=torch.int32)
        qlens = torch.tensor(query_lens, dtype=torch.int64)
        starts = torch.zeros(len(query_lens) + 1, dtype=torch.int64)
        torch.cumsum(qlens, 0, out=starts[1:])
        owner = torch.repeat_interleave(torch.arange(len(query_lens)), qlens)  # sequence of each token
        pos = torch.tensor(context_lens, dtype=torch.int64)[owner] + torch.arange(len(input_ids)) - starts[owner]
        slots = table[owner, pos // page_size].to(torch.int64) * page_size + pos % page_size

        def put(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=True)

        return cls(
            input_ids=put(torch.tensor(input_ids, dtype=torch.int64)),
            positions=put(pos),
            query_start_loc=put(starts.to(torch.int32)),
            seq_lens=put(torch.tensor(seq_lens, dtype=torch.int32)),
            context_lens=put(torch.tensor(context_lens, dtype=torch.int32)),
            page_table=put(table),
            slot_mapping=put(slots),
            logits_indices=put(torch.tensor(logits_indices, dtype=torch.int64)),
            page_size=page_size,
            query_lens_cpu=list(query_lens),
            seq_lens_cpu=seq_lens,
            context_lens_cpu=list(context_lens),
        )
