"""A process group of one parallel dimension and the collectives the model runs on it.

The group is built without ``torch.distributed.init_process_group``: a TCP store on loopback and a
backend process group made directly (NCCL on CUDA and ROCm devices, gloo on the host), so an
engine leaves no global state behind in the caller's process and several engines can live in one.
Every collective has the group's timeout: a rank that stops answering fails the step, it never
hangs it. Each goes through ``host_work``, so a graph recorded on the host holds it too.
``SINGLE`` is the group of one process, whose collectives are the identity.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..families.graphs import host_work
from .multicast import multicast_off

_OPS = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}


class ParallelGroup:
    """``rank`` of ``size`` processes; ``pg`` the backend process group (None for one process)."""

    def __init__(self, rank: int = 0, size: int = 1, pg=None) -> None:
        self.rank = rank
        self.size = size
        self.pg = pg

    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """x reduced over the group, in place."""
        if self.size > 1:
            opts = dist.AllreduceOptions()
            opts.reduceOp = _OPS[op]
            host_work(lambda: self.pg.allreduce([x], opts).wait())
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's x, concatenated along ``dim`` in rank order."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        host_work(lambda: self.pg.allgather([parts], [x]).wait())
        return torch.cat(parts, dim=dim)

    def all_to_all(self, x: torch.Tensor, send: list[int], receive: list[int]) -> torch.Tensor:
        """Rows of x sent in order, ``send[r]`` of them to rank r; the ``receive[r]`` rows from each
        rank r come back concatenated in rank order."""
        if self.size == 1:
            return x
        out = x.new_empty((sum(receive), *x.shape[1:]))
        x = x.contiguous()
        host_work(lambda: self.pg.alltoall_base(out, x, receive, send, dist.AllToAllOptions()).wait())
        return out

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """``src``'s x written into every rank's x, in place."""
        if self.size > 1:
            opts = dist.BroadcastOptions()
            opts.rootRank = src
            host_work(lambda: self.pg.broadcast([x], opts).wait())
        return x

    def anyone(self, flag: bool, device: torch.device) -> bool:
        """Whether ``flag`` holds on any rank (every rank asks together)."""
        if self.size == 1:
            return flag
        return bool(self.all_reduce(torch.tensor([int(flag)], device=device), "max").item())

    def close(self, abort: bool = False) -> None:
        """Release the backend group; ``abort`` also fails any collective in flight (a peer died)."""
        if self.pg is not None:
            (self.pg.abort if abort else self.pg.shutdown)()
            self.pg = None

    def __repr__(self) -> str:
        return f"ParallelGroup(rank={self.rank}, size={self.size})"


SINGLE = ParallelGroup()


def master_store(size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0's store on a free loopback port (``store.port``), which the other ranks join."""
    return dist.TCPStore("127.0.0.1", 0, size, is_master=True, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def join_store(port: int, size: int, timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


def rank_device(device: torch.device, rank: int) -> torch.device:
    """A rank's device: on GPUs the one ``rank`` places after ``device`` (made current), else ``device``."""
    if device.type != "cuda":
        return device
    device = torch.device("cuda", (device.index or 0) + rank)
    torch.cuda.set_device(device)
    return device


@dataclass
class Rendezvous:
    """Where one rank meets the others: its rank, their number and the store they share."""

    rank: int
    size: int
    store: dist.Store
    timeout_s: float

    def connect(self, device: torch.device, name: str = "tp") -> ParallelGroup:
        return connect(self.store, self.rank, self.size, device, self.timeout_s, name)

    def split(self, device: torch.device, size: int, name: str) -> ParallelGroup:
        """This rank's group of ``size`` consecutive ranks (k*size .. (k+1)*size - 1); one process: ``SINGLE``."""
        if size == 1:
            return SINGLE
        return connect(self.store, self.rank % size, size, device, self.timeout_s, f"{name}{self.rank // size}")


def connect(store: dist.Store, rank: int, size: int, device: torch.device, timeout_s: float,
            name: str = "tp") -> ParallelGroup:
    """This rank's group over ``store``: NCCL (RCCL) on a CUDA device, gloo on the host; NVLink
    multicast off (multicast.py)."""
    multicast_off()
    store = dist.PrefixStore(name, store)
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(store, rank, size, opts)
    else:
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        pg = dist.ProcessGroupGloo(store, rank, size, opts)
    return ParallelGroup(rank, size, pg)
