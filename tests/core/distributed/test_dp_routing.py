"""Where data-parallel attention sends a request (core/distributed/dp_router.py). The router alone:
a prompt goes to the rank caching its longest prefix within the load threshold, a prefix every
request shares does not draw them all to one rank, a rank's pages are bounded by its KV pages. Then
tiny-dsv4-py on 2 processes over gloo, 3 tenants with prefixes of their own sending a turn each per
round: prefix routing keeps each tenant on one rank and hits the ranks' prefix caches more often
than round robin (which moves each tenant between the ranks every round), with the greedy tokens
of one process. One 2-rank engine at a time."""

from __future__ import annotations

import random

import torch

from engine import LLM, SamplingParams
from engine.core.distributed.dp_router import DataParallelRouter, page_hashes

from tp_helpers import DSV4_OPTS, TIMEOUT_S, within

PARAMS = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)


def test_a_prompt_goes_to_the_rank_caching_its_longest_prefix():
    router = DataParallelRouter(3, "prefix", 2, 4, pages_per_rank=64)
    a, b = list(range(100, 140)), list(range(200, 240))  # 10 pages each
    assert router.place(a, [0, 0, 0]) == 0  # nothing cached: the least loaded, the lowest first
    assert router.place(b, [1, 0, 0]) == 1
    assert router.place(a + [7], [2, 0, 0]) == 0  # a's 10 pages, 2 requests above the least loaded
    assert router.place(a + [7], [3, 0, 0]) == 1  # 3 above: passed over (rank 1 now caches a too)
    assert router.place(a[:8], [0, 0, 0]) == 0  # ranks 0 and 1 hold its 2 pages: the lowest
    assert router.place(b[:20] + a, [0, 1, 0]) == 1  # b's first 5 pages, on rank 1 only


def test_a_prefix_every_request_shares_does_not_draw_them_all_to_one_rank():
    router, load = DataParallelRouter(2, "prefix", 1, 4, pages_per_rank=64), [0, 0]
    system = list(range(1000, 1032))
    for i in range(8):
        load[router.place(system + [i] * 8, load)] += 1
    assert load == [4, 4]


def test_a_rank_holds_no_more_pages_than_its_kv_cache():
    router = DataParallelRouter(2, "prefix", 4, 4, pages_per_rank=8)
    old, new = list(range(10, 42)), list(range(50, 82))  # 8 pages each
    assert router.place(old, [0, 0]) == router.place(new, [0, 0]) == 0
    cached = router.cached[0]
    assert len(cached.pages) == 8
    assert (cached.match(page_hashes(old, 4)), cached.match(page_hashes(new, 4))) == (0, 8)  # old's evicted


def hit_rate(dsv4, method: str, rounds: list[list[list[int]]], expected: list[list[list[int]]]) -> float:
    """The ranks' prefix-cache hit rate over ``rounds`` routed by ``method``, each round's greedy tokens
    checked against ``expected``."""
    llm = within(TIMEOUT_S, lambda: LLM(dsv4, tensor_parallel_size=2, data_parallel_size=2, enable_dp_attention=True,
                                        expert_parallel=True, load_balance_method=method,
                                        distributed_timeout=TIMEOUT_S, **DSV4_OPTS))
    try:
        for batch, want in zip(rounds, expected):
            assert [o.outputs[0].token_ids for o in within(TIMEOUT_S, lambda: llm.generate(batch, PARAMS))] == want
        s = llm.engine.stats()
        return s.prefix_cache_hits / s.prefix_cache_queries
    finally:
        llm.engine.shutdown()


def test_prefix_routing_hits_the_ranks_caches_more_than_round_robin(dsv4, single, run_seed):
    rng, vocab = random.Random(run_seed), single.engine.vocab_size
    torch.set_num_threads(1)  # as the ranks run: on a busy 2-core host spinning threads cost 10x
    prefixes = [[rng.randrange(3, vocab) for _ in range(48)] for _ in range(3)]
    rounds = [[p + [rng.randrange(3, vocab) for _ in range(6)] for p in prefixes] for _ in range(4)]
    expected = [[o.outputs[0].token_ids for o in single.generate(batch, PARAMS)] for batch in rounds]
    prefix, round_robin = (hit_rate(dsv4, m, rounds, expected) for m in ("prefix", "round_robin"))
    assert prefix > round_robin + 0.1, (prefix, round_robin)  # 0.68 (9 later turns of 9 hit) and 0.45 (6) here
