"""How an MoE layer's experts are spread over a tensor-parallel group, and how its tokens meet them.

- ``ExpertShards`` (tensor parallel, the default): every rank holds every expert, a 1/size share
  of each one's intermediate rows (gate/up split by rows, down by columns); it computes every token
  and one all-reduce sums the shares, as a row-parallel linear does. With one rank: the plain layer.
- ``ExpertParallel`` (``--expert-parallel``): rank r holds experts r*E/size .. (r+1)*E/size - 1
  whole. The processes that hold the same tokens (``share``: every rank under tensor-parallel
  attention) each route a slice of them; a dispatcher sends every (token, expert) pair to the rank
  that holds the expert, that rank runs them, the dispatcher brings the results back and sums them
  per token, and the slices are gathered within ``share``. A shared expert (every token's) is held
  whole by every rank and runs on the rank's slice. Two dispatchers, as DeepEP has a normal and a
  low-latency mode: ``AllToAllDispatch`` (eager steps) sends exactly each rank's pairs, their
  counts read on the host; ``PaddedAllToAllDispatch`` (within ``padded_exchanges``: while a decode
  or prefill graph is captured) sends fixed-size padded blocks, so the graph holds its all_to_all;
  there the whole exchange is ``bucket_shaped``, so a breakable prefill graph's breaks inside it (a
  MoE backend that reads the host) take the blocks whole. A fused
  dispatch (DeepEP's kernels, or MegaMoE's) is another ``Dispatcher``.

Under data-parallel attention (dp_attention.py) each data-parallel rank's tokens are its own
requests', not a copy of everyone's, and a rank may have none (it still joins every exchange,
with zero rows, or in a graph with a batch of padding):

- with ``--expert-parallel`` each rank's processes route its tokens, each its slice (``share`` is
  the rank's attention group), and the dispatcher sends them to the experts' ranks and back, as
  SGLang's DP attention with DeepEP does; each rank keeps its own rows.
- ``GatheredExpertShards`` (experts split): the ranks' tokens (and their ids, which hash routing
  reads) are all-gathered, padded to the longest, each token once (each of a rank's processes
  gives its slice), every process computes its share of every expert on all of them, one
  all-reduce sums the shares and the rows go back to their rank, as SGLang gathers before a
  tensor-parallel MoE and scatters after.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import Callable, Iterator, Protocol

import torch

from ..families.graphs import bucket_shaped
from .group import SINGLE, ParallelGroup
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
    (and local expert ids with weights) sent with all_to_all, and the outputs sent back the same way.
    Each rank receives exactly its pairs; the counts are read on the host."""

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
        x_in = g.all_to_all(x[token], send, receive)
        r_in = g.all_to_all(_routes(ids.flatten()[order] - dest[order] * self.per_rank, weights.flatten()[order]),
                            send, receive)
        if x_in.shape[0]:
            y_in = experts(x_in, r_in[:, 1:].contiguous(), r_in[:, :1].to(torch.int64))
        else:
            y_in = x_in
        y = g.all_to_all(y_in, receive, send)
        return torch.zeros_like(x).index_add_(0, token, y.to(x.dtype))


class PaddedAllToAllDispatch(AllToAllDispatch):
    """Sizes fixed by the batch's shape, so a graph can hold the exchange (DeepEP's low-latency
    mode, in torch.distributed's all_to_all): every rank sends every other a block of T * k rows
    (room for all its pairs), its pairs first in the order the exact dispatch sends them, then
    zero rows with weight 0 and expert id -1, which names no expert: the experts' alignment places
    them in no block, so the experts compute only the pairs sent (``MoEBackend.experts``), and their
    output rows are never read back. Every rank's batch must have the same T; nothing is read on
    the host. The per-token sums add in the exact dispatch's order."""

    def run(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: Experts) -> torch.Tensor:
        g, (t, k) = self.group, ids.shape
        cap = t * k
        dest = (ids // self.per_rank).flatten()
        order = torch.argsort(dest, stable=True)
        token = order // k
        # the slot of each pair (in the exact dispatch's order): its rank's block, after the earlier pairs to that rank
        to = dest[order]
        seen = (to[:, None] == torch.arange(g.size, device=to.device)).cumsum(0)  # one_hot would check on the host
        slot = to * cap + seen.gather(1, to[:, None]).squeeze(1) - 1
        x_out = x.new_zeros((g.size * cap, x.shape[1])).index_copy_(0, slot, x[token])
        routes = _routes(ids.flatten()[order] - to * self.per_rank, weights.flatten()[order])
        r_out = routes.new_zeros((g.size * cap, 2))
        r_out[:, 0] = -1  # the padding's expert: none
        r_out.index_copy_(0, slot, routes)
        blocks = [cap] * g.size
        x_in, r_in = g.all_to_all(x_out, blocks, blocks), g.all_to_all(r_out, blocks, blocks)
        y_in = experts(x_in, r_in[:, 1:].contiguous(), r_in[:, :1].to(torch.int64)) if cap else x_in
        y = g.all_to_all(y_in, blocks, blocks)
        return torch.zeros_like(x).index_add_(0, token, y[slot].to(x.dtype))


def _routes(local: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Each pair's local expert id and weight as one fp32 message (the ids are small integers, exact in fp32)."""
    return torch.stack([local.to(torch.float32), weights.to(torch.float32)], dim=1)


_PADDED: ContextVar[bool] = ContextVar("padded_exchanges", default=False)


def _exchange() -> contextlib.AbstractContextManager:
    """Where an exchange runs: padded, its work is the bucket's whole, not the step's tokens'."""
    return bucket_shaped() if _PADDED.get() else contextlib.nullcontext()


@contextlib.contextmanager
def padded_exchanges() -> Iterator[None]:
    """Within it, every MoE exchange has sizes fixed by the batch's shape and reads nothing on the
    host, as a captured graph needs (core/graph_runner.py); every rank's batch has the same size."""
    token = _PADDED.set(True)
    try:
        yield
    finally:
        _PADDED.reset(token)


class ExpertParallel:
    """``share``: the processes that hold the same tokens (the whole group under tensor-parallel
    attention, a data-parallel rank's processes under DP attention): each routes and sends its
    slice of them (the tokens padded to a multiple of ``share.size``) and the slices are gathered
    within ``share``. ``dispatcher`` moves the pairs in eager steps, ``padded`` in graphs."""

    folds_shared = False  # the shared expert is held whole by every rank, the routed ones are not

    def __init__(self, group: ParallelGroup, share: ParallelGroup | None = None, dispatcher: Dispatcher | None = None,
                 padded: Dispatcher | None = None) -> None:
        self.group = group
        self.share = group if share is None else share
        self.dispatcher = dispatcher
        self.padded = padded

    def place(self, num_experts: int, inter: int) -> tuple[int, int, tuple[int, int]]:
        per_rank = split(num_experts, self.group.size, "the routed experts")
        if self.dispatcher is None:
            self.dispatcher = AllToAllDispatch(self.group, per_rank)
        if self.padded is None:
            self.padded = PaddedAllToAllDispatch(self.group, per_rank)
        return self.group.rank * per_rank, per_rank, (0, 1)

    shared_split = (0, 1)

    def __call__(self, layer: ExpertLayer, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        with _exchange():
            return self._exchange(layer, x, input_ids)

    def _exchange(self, layer: ExpertLayer, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        k = layer.top_k
        xs, ids_s = share_slice(self.share, x, input_ids)
        if xs.shape[0]:
            weights, ids = layer.route(xs, ids_s)
        else:  # no tokens (an idle data-parallel rank): it takes part in the exchange all the same
            weights, ids = xs.new_empty((0, k), dtype=torch.float32), input_ids.new_empty((0, k))
        dispatcher = self.padded if _PADDED.get() else self.dispatcher
        y = dispatcher.run(xs, weights[:, :k], ids[:, :k], layer.routed)
        if weights.shape[1] > k:
            y = y + layer.shared(xs, weights[:, k:], ids[:, k:])
        return self.share.all_gather(y, dim=0)[:x.shape[0]]


def share_slice(share: ParallelGroup, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This process's slice of tokens that every process of ``share`` holds: ceil(T / size) rows,
    the tokens padded to fill the last slice (the padding rows are routed, their outputs dropped)."""
    total = x.shape[0]
    rows = -(-total // share.size)
    if rows * share.size > total:
        x = torch.nn.functional.pad(x, (0, 0, 0, rows * share.size - total))
        input_ids = torch.nn.functional.pad(input_ids, (0, rows * share.size - total))
    return x[share.rank * rows: (share.rank + 1) * rows], input_ids[share.rank * rows: (share.rank + 1) * rows]


class GatheredExpertShards(ExpertShards):
    """``share``: the processes of this one's data-parallel rank, which hold its tokens; each
    contributes its slice of them to the gather, and the rows come back within ``share``. Within
    ``padded_exchanges`` every process's slice has one size: nothing is read on the host."""

    def __init__(self, group: ParallelGroup, share: ParallelGroup) -> None:
        super().__init__(group)
        self.share = share

    def __call__(self, layer: ExpertLayer, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        with _exchange():
            return self._exchange(layer, x, input_ids)

    def _exchange(self, layer: ExpertLayer, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        g, total = self.group, x.shape[0]
        xs, ids_s = share_slice(self.share, x, input_ids)
        part = xs.shape[0]
        rows = part if _PADDED.get() else max(g.all_gather(torch.tensor([part], device=x.device), dim=0).tolist())
        if rows == 0:
            return x
        xg = g.all_gather(torch.nn.functional.pad(xs, (0, 0, 0, rows - part)), dim=0)
        ids = g.all_gather(torch.nn.functional.pad(ids_s, (0, rows - part)), dim=0)
        y = g.all_reduce(layer.route_and_combine(xg, ids))
        return self.share.all_gather(y[g.rank * rows: g.rank * rows + part], dim=0)[:total]


@torch.inference_mode()
def idle_forward(model: torch.nn.Module) -> None:
    """A forward with no tokens: each MoE layer's exchange with the other ranks, in layer order."""
    param = next(model.parameters())
    hidden = model.config.hf["hidden_size"]
    x = torch.empty((0, hidden), dtype=model.config.dtype, device=param.device)
    ids = torch.empty((0,), dtype=torch.int64, device=param.device)
    for m in model.modules():
        if hasattr(m, "placement"):
            m.placement(m, x, ids)


def expert_placement(group: ParallelGroup, expert_parallel: bool, data_parallel: bool = False,
                     attention: ParallelGroup | None = None) -> ExpertShards | ExpertParallel:
    """``data_parallel``: each data-parallel rank's tokens are its own (data-parallel attention), not
    all of them, held by the processes of its ``attention`` group."""
    if group.size == 1:
        return ExpertShards(group)
    if data_parallel:
        attention = SINGLE if attention is None else attention
        return ExpertParallel(group, attention) if expert_parallel else GatheredExpertShards(group, attention)
    return ExpertParallel(group) if expert_parallel else ExpertShards(group)
