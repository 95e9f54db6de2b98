"""How an MoE layer's experts are spread over a tensor-parallel group, and how its tokens meet them.

- ``ExpertShards`` (tensor parallel, the default): every rank holds every expert, a 1/size share
  of each one's intermediate rows (gate/up split by rows, down by columns); it computes every token
  and one all-reduce sums the shares, as a row-parallel linear does. With one rank: the plain layer.
- ``ExpertParallel`` (``--expert-parallel``): rank r holds experts r*E/size .. (r+1)*E/size - 1
  whole. The tokens are on every rank (attention is tensor-parallel), so each rank routes its own
  slice of them; a dispatcher sends every (token, expert) pair to the rank that holds the expert,
  that rank runs them, the dispatcher brings the results back and sums them per token, and the
  slices are gathered. A shared expert (every token's) is held whole by every rank and runs on the
  rank's slice. ``AllToAllDispatch`` is torch.distributed's all_to_all; a fused dispatch (DeepEP
  style, or MegaMoE's) is another ``Dispatcher``.

Under data-parallel attention (dp_attention.py) each rank's tokens are its own requests', not a
copy of everyone's, and a rank may have none (it still joins every exchange, with zero rows):

- ``DataParallelExperts`` (with ``--expert-parallel``): each rank routes all of its tokens and the
  dispatcher sends them to the experts' ranks and back, as SGLang's DP attention with DeepEP does;
  nothing is gathered, each rank keeps its own rows.
- ``GatheredExpertShards`` (experts split): the ranks' tokens (and their ids, which hash routing
  reads) are all-gathered, padded to the longest, every rank computes its share of every expert on
  all of them, one all-reduce sums the shares and each rank keeps its rows, as SGLang gathers
  before a tensor-parallel MoE and scatters after.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from .group import ParallelGroup
from .layers import split

Experts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (x, weights, ids) -> [T, H]


class ExpertLayer(Protocol):
    """What a placement needs of an MoE layer."""

    top_k: int  # routed columns of a route; a shared expert's column comes after them

    def route(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Routing weights and expert ids [T, top_k (+ 1 shared)]."""

    def combined(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Every column of a route through the experts this rank holds, summed per token."""

    def route_and_combine(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """``combined`` of ``route``, as one call to the MoE backend where the layer's experts are one
        stack (``MoEBackend.route_experts``: a backend may fuse the routing into the experts)."""

    def routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Routed columns through the routed stack (ids local to it)."""

    def shared(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The shared expert's column through the shared stack."""


class ExpertShards:
    folds_shared = True  # the shared expert may sit in the routed stack: it is split as they are
    graph_safe = True

    def __init__(self, group: ParallelGroup) -> None:
        self.group = group

    def place(self, num_experts: int, inter: int) -> tuple[int, int, tuple[int, int]]:
        """(first expert, experts, (part, parts) of each one's intermediate rows) this rank holds."""
        split(inter, self.group.size, "moe_intermediate_size")
        return 0, num_experts, (self.group.rank, self.group.size)

    @property
    def shared_split(self) -> tuple[int, int]:
        return self.group.rank, self.group.size

    def __call__(self, layer: ExpertLayer, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(layer.route_and_combine(x, input_ids))


class Dispatcher(Protocol):
    def run(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: Experts) -> torch.Tensor:
        """Each token of x [T, H] through its experts ``ids`` [T, k] (global ids) wherever they are
        held, weighted by ``weights`` and summed: [T, H]. ``experts`` runs this rank's on what it receives."""


class AllToAllDispatch:
    """Pairs sorted by the rank holding their expert, their counts exchanged, then the token rows
    (and local expert ids with weights) sent with all_to_all, and the outputs sent back the same way."""

    def __init__(self, group: ParallelGroup, experts_per_rank: int) -> None:
        self.group = group
        self.per_rank = experts_per_rank

    def run(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: Experts) -> torch.Tensor:
        g, k = self.group, ids.shape[1]
        dest = (ids // self.per_rank).flatten()
        order = torch.argsort(dest, stable=True)
        token = order // k
        send_counts = torch.bincount(dest, minlength=g.size)
        send = send_counts.tolist()
        receive = g.all_to_all(send_counts, [1] * g.size, [1] * g.size).tolist()
        local = ids.flatten()[order] - dest[order] * self.per_rank
        # local expert ids are small integers, exact in fp32: one message with the weights
        routes = torch.stack([local.to(torch.float32), weights.flatten()[order].to(torch.float32)], dim=1)
        x_in = g.all_to_all(x[token], send, receive)
        r_in = g.all_to_all(routes, send, receive)
        if x_in.shape[0]:
            y_in = experts(x_in, r_in[:, 1:].contiguous(), r_in[:, :1].to(torch.int64))
        else:
            y_in = x_in
        y = g.all_to_all(y_in, receive, send)
        return torch.zeros_like(x).index_add_(0, token, y.to(x.dtype))


class ExpertParallel:
    folds_shared = False  # the shared expert is held whole by every rank, the routed ones are not
    graph_safe = False  # the all_to_all's sizes are read on the host

    def __init__(self, group: ParallelGroup, dispatcher: Dispatcher | None = None) -> None:
        self.group = group
        self.dispatcher = dispatcher

    def place(self, num_experts: int, inter: int) -> tuple[int, int, tuple[int, int]]:
        per_rank = split(num_experts, self.group.size, "the routed experts")
        if self.dispatcher is None:
            self.dispatcher = AllToAllDispatch(self.group, per_rank)
        return self.group.rank * per_rank, per_rank, (0, 1)

    shared_split = (0, 1)

    def __call__(self, layer: ExpertLayer, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        g, total = self.group, x.shape[0]
        rows = -(-total // g.size)
        lo, hi = min(g.rank * rows, total), min((g.rank + 1) * rows, total)
        xs, k = x[lo:hi], layer.top_k
        if hi > lo:
            weights, ids = layer.route(xs, input_ids[lo:hi])
        else:  # fewer tokens than ranks: this one has none to route, and still takes part in the exchange
            weights, ids = xs.new_empty((0, k), dtype=torch.float32), input_ids.new_empty((0, k))
        y = self.dispatcher.run(xs, weights[:, :k], ids[:, :k], layer.routed)
        if weights.shape[1] > k:
            y = y + layer.shared(xs, weights[:, k:], ids[:, k:])
        padded = torch.nn.functional.pad(y, (0, 0, 0, rows - y.shape[0]))
        return g.all_gather(padded, dim=0)[:total]


class DataParallelExperts(ExpertParallel):
    def __call__(self, layer: ExpertLayer, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        k = layer.top_k
        if x.shape[0]:
            weights, ids = layer.route(x, input_ids)
        else:  # an idle rank: nothing to send, and it takes part in the exchange all the same
            weights, ids = x.new_empty((0, k), dtype=torch.float32), input_ids.new_empty((0, k))
        y = self.dispatcher.run(x, weights[:, :k], ids[:, :k], layer.routed)
        if weights.shape[1] > k:
            y = y + layer.shared(x, weights[:, k:], ids[:, k:])
        return y


class GatheredExpertShards(ExpertShards):
    graph_safe = False  # the ranks' token counts are read on the host

    def __call__(self, layer: ExpertLayer, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        g, total = self.group, x.shape[0]
        counts = g.all_gather(torch.tensor([total], device=x.device), dim=0).tolist()
        rows = max(counts)
        if rows == 0:
            return x
        xs = g.all_gather(torch.nn.functional.pad(x, (0, 0, 0, rows - total)), dim=0)
        ids = g.all_gather(torch.nn.functional.pad(input_ids, (0, rows - total)), dim=0)
        y = g.all_reduce(layer.route_and_combine(xs, ids))
        return y[g.rank * rows: g.rank * rows + total]


def expert_placement(group: ParallelGroup, expert_parallel: bool, data_parallel: bool = False) -> ExpertShards | ExpertParallel:
    """``data_parallel``: each rank's tokens are its own (data-parallel attention), not all of them."""
    if group.size == 1:
        return ExpertShards(group)
    if data_parallel:
        return DataParallelExperts(group) if expert_parallel else GatheredExpertShards(group)
    return ExpertParallel(group) if expert_parallel else ExpertShards(group)
