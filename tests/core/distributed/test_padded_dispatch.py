"""The expert-parallel exchanges, each rank a thread of this process on one gloo group: the
fixed-size padded dispatch (what a decode graph holds) gives what the exact one does and what one
process computes with every expert at hand, whatever the routes (all pairs to one rank, none to
another, a batch of no tokens); and recorded on the host graphs backend, collectives included,
its replays recompute the exchange on new tokens and routes. The padding rows name no expert: a
rank's MoE experts compute only the pairs sent to it (the native MoE's MLP rows here; on 2 GPUs the
Triton alignment's blocks), as many over the ranks as the batches route. Under data-parallel
attention the ranks agree on the graph every one replays, decode, verify or prefill, and its
bucket (core/graph_choice.py)."""

from __future__ import annotations

import threading

import pytest
import torch

from engine.core.distributed.group import connect, join_store, master_store
from engine.core.families.moe import ExpertWeights
from engine.core.graph_choice import GraphChoice
from engine.core.graph_runner import DecodeGraphs
from engine.core.prefill_graphs import PrefillGraphs
from engine.core.distributed.moe import AllToAllDispatch, PaddedAllToAllDispatch
from engine.core.native import moe as native_moe
from engine.core.native.graphs import RecordedOps

from tp_helpers import TIMEOUT_S, within

H, E, K = 8, 8, 3


def linear_experts(maps: torch.Tensor, first: int):
    """Expert e multiplies by maps[e] (global ids; this rank's from ``first``): torch operators only."""
    def run(x, weights, ids):
        return torch.einsum("th,tkhg,tk->tg", x, maps[ids + first], weights)
    return run


def one_process(maps, x, weights, ids):
    return linear_experts(maps, 0)(x, weights, ids)


def moe_experts(backend, stack: ExpertWeights, first: int, per_rank: int):
    """This rank's experts of ``stack`` (from ``first``) through the MoE ``backend``, as a layer's ``routed``."""
    local = ExpertWeights(stack.gate_up[first:first + per_rank], stack.down[first:first + per_rank])
    return lambda x, weights, ids: backend.experts(x, weights, ids, local)


def random_stack(inner: int, dtype: torch.dtype, hidden: int = H) -> ExpertWeights:
    return ExpertWeights((torch.randn(E, 2 * inner, hidden) * hidden**-0.5).to(dtype),
                         (torch.randn(E, hidden, inner) * inner**-0.5).to(dtype))


def ranks(size: int, body, device=lambda r: torch.device("cpu")) -> list:
    """Each rank's ``body(rank, group)``, the ranks threads on one group of ``device(rank)``s (gloo on the host)."""
    store = master_store(size, TIMEOUT_S)
    out: list = [None] * size
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            g = connect(store if r == 0 else join_store(store.port, size, TIMEOUT_S), r, size,
                        device(r), TIMEOUT_S, "ep")
            out[r] = body(r, g)
            g.close()
        except BaseException as exc:
            errors.append(exc)

    def run_all() -> None:
        threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    within(TIMEOUT_S, run_all)
    if errors:
        raise errors[0]
    return out


def routes(gen: torch.Generator, t: int, skew: str) -> torch.Tensor:
    """Distinct experts per token; ``skew``: 'low' sends every pair to rank 0's experts."""
    top = E // 2 if skew == "low" else E
    return torch.stack([torch.randperm(top, generator=gen)[:K] for _ in range(t)]) if t else torch.empty(0, K, dtype=torch.int64)


@pytest.mark.parametrize("size", [2, 4])
def test_padded_dispatch_is_the_exact_one(size):
    maps = torch.randn(E, H, H, generator=torch.Generator().manual_seed(0))
    per_rank = E // size

    def body(r, g):
        gen = torch.Generator().manual_seed(100 + r)
        got = []
        for t, skew in ((5, "any"), (3, "low"), (1, "any"), (0, "any")):
            x, w = torch.randn(t, H, generator=gen), torch.rand(t, K, generator=gen)
            ids = routes(gen, t, skew)
            experts = linear_experts(maps, r * per_rank)
            exact = AllToAllDispatch(g, per_rank).run(x, w, ids, experts)
            padded = PaddedAllToAllDispatch(g, per_rank).run(x, w, ids, experts)
            got.append((exact, padded, one_process(maps, x, w, ids)))
        return got

    for got in ranks(size, body):
        for exact, padded, want in got:
            torch.testing.assert_close(exact, want)
            torch.testing.assert_close(padded, exact, rtol=0, atol=0)


@pytest.mark.parametrize("size", [2, 4])
def test_padding_rows_reach_no_expert(size, seed, monkeypatch):
    """Through the native MoE each rank's expert MLPs compute the rows of the pairs sent to it, not
    the size * T * K rows of its blocks: over the ranks, the pairs routed; the outputs the exact
    dispatch's to the bit, and one process's with every expert at hand."""
    stack, per_rank, t = random_stack(4, torch.float32), E // size, 5
    computed: list[int] = []  # rows through an expert MLP, every rank's
    swiglu = native_moe._swiglu
    monkeypatch.setattr(native_moe, "_swiglu",
                        lambda gate_up, w: computed.append(gate_up.shape[0]) or swiglu(gate_up, w))

    def body(dispatch):
        def run(r, g):
            gen = torch.Generator().manual_seed(seed + r)
            x, w, ids = torch.randn(t, H, generator=gen), torch.rand(t, K, generator=gen), routes(gen, t, "any")
            experts = moe_experts(native_moe.NativeMoE(None), stack, r * per_rank, per_rank)
            return dispatch(g, per_rank).run(x, w, ids, experts), (x, w, ids)
        return run

    padded = ranks(size, body(PaddedAllToAllDispatch))
    assert sum(computed) == size * t * K
    for (got, (x, w, ids)), (exact, _) in zip(padded, ranks(size, body(AllToAllDispatch))):
        torch.testing.assert_close(got, exact, rtol=0, atol=0)
        torch.testing.assert_close(got, native_moe.NativeMoE(None).experts(x, w, ids, stack))


@pytest.mark.gpu
@pytest.mark.parametrize("t", [4, 40])  # the decode alignment's one chunk of pairs, and several
def test_padding_rows_fill_no_block_of_the_triton_experts_gpu(t, seed, monkeypatch):
    """On 2 GPUs over NCCL, each rank's Triton experts align only the pairs sent to it: the grouped
    GEMMs' rows in use (``num_padded``) are its experts' pair counts rounded up to whole blocks, not
    its 2 * T * K rows; the outputs one process's with every expert at hand."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    from engine.backends.triton import fused_moe
    from engine.backends.triton.moe import TritonMoE

    size, per_rank, hidden = 2, E // 2, 64
    stack = random_stack(64, torch.bfloat16, hidden)
    aligned: dict[int, list] = {0: [], 1: []}  # each GPU's alignments
    align = fused_moe.align_by_expert

    def recorded(ids, num_experts, block_m):
        blocks = align(ids, num_experts, block_m)
        aligned[ids.device.index].append(blocks)
        return blocks

    monkeypatch.setattr(fused_moe, "align_by_expert", recorded)

    def body(r, g):
        torch.cuda.set_device(r)
        gen, dev = torch.Generator().manual_seed(seed + r), torch.device("cuda", r)
        x, w, ids = torch.randn(t, hidden, generator=gen), torch.rand(t, K, generator=gen), routes(gen, t, "any")
        x, w, ids = x.to(dev, torch.bfloat16), w.to(dev), ids.to(dev)
        held = ExpertWeights(stack.gate_up.to(dev), stack.down.to(dev))
        got = PaddedAllToAllDispatch(g, per_rank).run(x, w, ids, moe_experts(TritonMoE(None), held, r * per_rank,
                                                                             per_rank))
        return got, native_moe.NativeMoE(None).experts(x, w, ids, held), ids.cpu()

    out = ranks(size, body, lambda r: torch.device("cuda", r))
    counts = torch.bincount(torch.cat([ids.flatten() for _, _, ids in out]), minlength=E)
    for r, (got, want, _) in enumerate(out):
        (blocks,) = aligned[r]
        mine = counts[r * per_rank:(r + 1) * per_rank]
        assert int(blocks.num_padded) == int((-(-mine // blocks.block_m) * blocks.block_m).sum())
        assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 1e-2


def test_a_recorded_padded_dispatch_replays_its_exchanges():
    maps = torch.randn(E, H, H, generator=torch.Generator().manual_seed(1))
    size, t, per_rank = 2, 4, E // 2

    def body(r, g):
        gen = torch.Generator().manual_seed(200 + r)
        x, w, ids = torch.randn(t, H, generator=gen), torch.rand(t, K, generator=gen), routes(gen, t, "any")
        dispatch, experts = PaddedAllToAllDispatch(g, per_rank), linear_experts(maps, r * per_rank)
        replay = RecordedOps(None).capture(lambda: dispatch.run(x, w, ids, experts))
        got = []
        for skew in ("low", "any", "any"):
            x.copy_(torch.randn(t, H, generator=gen))
            w.copy_(torch.rand(t, K, generator=gen))
            ids.copy_(routes(gen, t, skew))
            got.append((replay().clone(), one_process(maps, x, w, ids)))
        return got

    for got in ranks(size, body):
        for replayed, want in got:
            torch.testing.assert_close(replayed, want)


@pytest.mark.parametrize("offers,bucket", [
    ((3, 0), 4), ((1, 2), 4), ((2, 0), 4), ((5, 8), 8), ((0, 0), None), ((None, 2), None), ((2, 9), None)])
def test_the_ranks_agree_on_one_decode_bucket(offers, bucket):
    """The bucket of the largest batch, or eager (None) where a rank's step fits no graph or no rank
    has sequences (9 exceed the largest bucket, 8); and where a rank lacks the small buckets (rank 1
    none below 4), one both hold."""

    def body(r, g):
        graphs = DecodeGraphs(None, None, None, 4, 64, 8, torch.device("cpu"))
        graphs.buckets = [1, 2, 4, 8] if r == 0 else [4, 8]
        chosen = GraphChoice([graphs], g).choose([None if offers[r] is None or offers[r] > 8 else offers[r]])
        return None if chosen is None else chosen[1]

    assert ranks(2, body) == [bucket, bucket]


D, V, P = "decode", "verify", "prefill"


@pytest.mark.parametrize("steps,plan", [
    (((3, None, 3), (1, None, 1)), (D, 4)),  # both decode
    (((3, None, 3), (0, 0, 0)), (D, 4)),  # one idle
    (((None, 2, 8), (0, 0, 0)), (V, 2)),  # one verifies 2 sequences, one idle
    (((None, 1, 4), (None, 3, 12)), (V, 4)),
    (((None, 2, 8), (3, None, 3)), (P, 16)),  # one verifies, one decodes: the prefill graphs hold both
    (((None, None, 20), (1, None, 1)), (P, 32)),  # a prefill chunk beside a decode
    (((None, None, 20), (0, 0, 0)), (P, 32)),
    (((None, None, None), (1, None, 1)), None),  # a step no graph holds: all eager
    (((None, None, 5), (None, None, None)), None),
    (((0, 0, 0), (0, 0, 0)), None),  # nothing scheduled anywhere
])
def test_the_ranks_agree_on_one_graph_of_three_kinds(steps, plan):
    """Each rank's step as its size in each kind (sequences, sequences, tokens; 0: idle, None: not
    held): every rank gets the first kind that holds every rank's step, through the bucket of the
    largest, never a kind that holds its own step but not another's."""

    def body(r, g):
        kinds = {D: DecodeGraphs(None, None, None, 4, 64, 8, torch.device("cpu")),
                 V: DecodeGraphs(None, None, None, 4, 64, 4, torch.device("cpu"), query_len=4),
                 P: PrefillGraphs(None, None, None, None, 4, 32, torch.device("cpu"))}
        kinds[D].buckets, kinds[V].buckets = [1, 2, 4, 8], [1, 2, 4]
        chosen = GraphChoice(list(kinds.values()), g).choose(list(steps[r]))
        return None if chosen is None else ({id(v): k for k, v in kinds.items()}[id(chosen[0])], chosen[1])

    assert ranks(2, body) == [plan, plan]
