"""The processes a proposer's drafting forwards span, where its layers are the target's kind (MTP's
next-n layer, DeepSeek-V4.1's DSpark stages): every forward is a collective they all run.

* Under tensor parallelism (or a data-parallel rank's attention split over its processes) the
  layers hold the target's slices: the process that schedules leads (``lead``), sending the others
  each forward's host data over the runner's peers (``send``) and broadcasting the tensors it feeds
  in, which only it keeps (``broadcast``); the others run what it sends (``SpecProposer.follow``).
* Under data-parallel attention the layers' MoE spans every rank, as the target's MoE layers do: a
  rank drafts its own requests, so the ranks first agree on the step's number of forwards (``count``),
  and a rank with fewer runs the rest with no tokens (``idle``), its attention group with it.
"""

from __future__ import annotations

import torch

from ..distributed.group import SINGLE
from ..distributed.messages import Draft, DraftCount
from ..distributed.moe import idle_forward


class DraftingGroup:
    def __init__(self, target, layers: torch.nn.Module, device: torch.device, split: bool = True) -> None:
        """``layers``: the proposer's modules; whether their MoE exchanges meet the other
        data-parallel ranks' decides the lockstep. ``split``: they hold the target's slices (else
        they are whole here, and this process runs them alone)."""
        moe = target.backends.moe_group
        exchanges = any(hasattr(m, "placement") for m in layers.modules())
        self.lockstep = moe if exchanges and target.backends.dp_attention and moe.size > 1 else None
        self.attention = target.backends.tp if split else SINGLE  # this one leads, the others follow
        self.layers, self.device = layers, device
        self.peers = None

    def lead(self, peers) -> None:
        if self.attention.size > 1:
            self.peers = peers

    def send(self, message) -> None:
        """One drafting forward's host data to the other processes of the attention group."""
        if self.peers is not None:
            self.peers.send(message)

    def count(self, n: int) -> int:
        """The drafting forwards of this step: ``n`` here, under data-parallel attention the most of any rank."""
        if self.lockstep is None:
            return n
        self.send(DraftCount())  # they join the count too
        return int(self.lockstep.all_reduce(torch.tensor([n], device=self.device), "max").item())

    def idle(self) -> None:
        """A forward with no tokens: this rank's part of the other ranks' exchanges."""
        self.send(Draft(None))
        idle_forward(self.layers)

    def broadcast(self, tensor: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """The leader's ``tensor`` (None on the others) on every process of the attention group;
        unchanged where the group is one process."""
        if self.attention.size == 1:
            return tensor
        tensor = (torch.empty(shape, dtype=dtype, device=self.device) if tensor is None
                  else tensor.to(dtype).contiguous())
        self.attention.broadcast(tensor, src=0)
        return tensor
