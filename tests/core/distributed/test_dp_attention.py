"""Data-parallel attention end to end: DeepSeek-V4 (tiny-dsv4-py) on 2 processes over gloo, each
rank serving its own requests through attention with its own KV cache and scheduler, the experts
partitioned over both (all_to_all), gives the greedy tokens of one process: through chunked
prefill, preemption (few pages per rank) and prefix-cache hits on the rank that holds the prefix;
with one rank idle while the other works (either way round); zeroing the counters zeroes every
rank's; a killed rank fails the engine naming it. And 4 processes in 2 data-parallel ranks, each
rank's attention tensor-parallel over 2 of them, the experts split (the ranks' tokens gathered).
One 2-rank engine per module (the failure test kills it last)."""

from __future__ import annotations

import argparse
import os
import random
import signal

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.config import EngineConfig
from engine.core.engine_stats import EngineCounters
from engine.core.errors import EngineDeadError
from engine.server.engine_args import add_engine_args, engine_config

from tp_helpers import DSV4_OPTS, TIMEOUT_S, within

OPTS = {k: v for k, v in DSV4_OPTS.items() if k != "num_pages"}
PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def dp2(dsv4):
    # few pages: the 3 prompts each rank gets cannot all run at once, so sequences are preempted
    llm = within(TIMEOUT_S, lambda: LLM(dsv4, num_pages=48, tensor_parallel_size=2, data_parallel_size=2,
                                        enable_dp_attention=True, expert_parallel=True,
                                        distributed_timeout=TIMEOUT_S, **OPTS))
    yield llm
    llm.engine.shutdown()


def tokens(llm: LLM, batch: list[list[int]], params=PARAMS) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in within(TIMEOUT_S, lambda: llm.generate(batch, params))]


def test_ranks_serve_their_own_requests_as_one_process_does(single, dp2, run_seed):
    rng, vocab = random.Random(run_seed), single.engine.vocab_size
    torch.set_num_threads(1)  # as the ranks run: on a busy 2-core host spinning threads cost 10x
    batch = [[rng.randrange(3, vocab) for _ in range(rng.randint(66, 90))] for _ in range(6)]
    long = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)  # the running outgrow the pages left
    expected = tokens(single, batch, long)
    assert tokens(dp2, batch, long) == expected  # placed alternately: prompts 0, 2, 4 on rank 0, 1, 3, 5 on rank 1
    # the last two extended by their outputs: each on the rank that ran it, which still caches its prefix
    again = [p + out + [rng.randrange(3, vocab) for _ in range(5)] for p, out in zip(batch[4:], expected[4:])]
    assert tokens(dp2, again) == tokens(single, again)
    stats, own = dp2.engine.stats(), dp2.engine.kv_manager.stats()
    assert stats.num_preemptions > 0, "the batch was meant to run short of pages"
    assert stats.prefix_cache_hits > own.prefix_hits > 0  # both ranks hit their own prefixes
    assert 0 < own.prefix_queries < stats.prefix_cache_queries  # rank 0 saw its share of the prompts only
    assert not dp2.engine.has_unfinished_requests() and stats.num_running == 0
    layer = dp2.engine.components.model.model.layers[2]
    whole = single.engine.components.model.model.layers[2]
    assert layer.attn.num_heads == whole.attn.num_heads  # attention whole on every rank
    assert layer.ffn.experts.gate_up.shape[0] == whole.ffn.num_experts // 2  # half the experts


def test_one_rank_idle_while_the_other_works(single, dp2, run_seed):
    rng, vocab = random.Random(run_seed + 1), single.engine.vocab_size
    prompt = [rng.randrange(3, vocab) for _ in range(70)]
    # one request: rank 0 serves it, rank 1 runs idle steps with it
    assert tokens(dp2, [prompt]) == tokens(single, [prompt])
    # a short one on rank 0 and a long one on rank 1: rank 0 idles for the rest of rank 1's request
    batch = [prompt[:40], prompt[10:]]
    params = [SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)]
    got = tokens(dp2, batch, params)
    assert got == tokens(single, batch, params) and [len(t) for t in got] == [1, 12]


def test_an_abort_reaches_the_rank_that_runs_the_request(dp2):
    engine = dp2.engine
    for rid, start in (("a", 10), ("b", 60)):  # "b" goes to rank 1 (no prefix in common with "a")
        engine.add_request(rid, list(range(start, start + 50)),
                           SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    within(TIMEOUT_S, engine.step)
    assert engine.dp.owner == {"b": 1}
    assert engine.abort_request("b") is None  # its last output comes with the next step
    ended = within(TIMEOUT_S, engine.step) + within(TIMEOUT_S, engine.step)
    assert [o.outputs[0].finish_reason for o in ended if o.request_id == "b" and o.finished] == ["abort"]
    assert engine.abort_request("a").outputs[0].finish_reason == "abort"
    assert not engine.has_unfinished_requests()


def test_zeroed_counters_are_every_ranks(dp2):
    engine = dp2.engine
    batch = [list(range(10, 50)), list(range(60, 100))]  # the first to rank 0, the second to rank 1
    tokens(dp2, batch)
    assert engine.stats().prefix_cache_queries > engine.kv_manager.stats().prefix_queries > 0
    engine.reset_counters()
    s = engine.stats()
    assert (s.prefix_cache_queries, s.prefix_cache_hits, s.num_preemptions) == (0, 0, 0)
    assert engine.counters == EngineCounters()
    tokens(dp2, batch)  # again, each on the rank that caches it
    s = engine.stats()
    assert s.prefix_cache_queries == 2 * 39  # both ranks' since the reset only (last tokens are never looked up)
    assert s.prefix_cache_hits > engine.kv_manager.stats().prefix_hits > 0
    assert engine.counters == EngineCounters(80, 2 * PARAMS.max_tokens, {"length": 2})  # rank 1's tokens too


def test_two_ranks_of_two_processes_each(single, dsv4, run_seed):
    """4 processes, 2 data-parallel ranks, each rank's attention split over its 2 processes (half the
    heads on each) and the experts split over all 4 (the ranks' tokens gathered): 6 prompts placed 3
    and 3, then one prompt on each rank in turn, the other idle; a killed process of rank 1 that does
    not schedule fails the engine naming it."""
    rng, vocab = random.Random(run_seed + 2), single.engine.vocab_size
    batch = [[rng.randrange(3, vocab) for _ in range(rng.randint(20, 70))] for _ in range(6)]
    llm = within(TIMEOUT_S, lambda: LLM(dsv4, num_pages=128, tensor_parallel_size=4, data_parallel_size=2,
                                        enable_dp_attention=True, distributed_timeout=TIMEOUT_S, **OPTS))
    try:
        assert tokens(llm, batch) == tokens(single, batch)
        looked_up = [len(p) - 1 for p in batch]  # a prompt's last token is always computed, never looked up
        assert llm.engine.kv_manager.stats().prefix_queries == sum(looked_up[::2])  # rank 0's share
        assert llm.engine.stats().prefix_cache_queries == sum(looked_up)  # the ranks' together
        for alone in (batch[1:2], batch[:1]):  # to the rank that caches it: the other rank's 2 processes idle
            assert tokens(llm, alone) == tokens(single, alone)
        layer, whole = llm.engine.components.model.model.layers[2], single.engine.components.model.model.layers[2]
        assert layer.attn.num_heads == whole.attn.num_heads // 2
        assert layer.ffn.experts.gate_up.shape[1] == whole.ffn.experts.gate_up.shape[1] // 4
        os.kill(llm.engine.workers.procs[2].pid, signal.SIGKILL)  # rank 3
        with pytest.raises(EngineDeadError, match=r"tensor-parallel rank 3 died \(exit code -9\)"):
            within(10, lambda: llm.generate(batch[:2], PARAMS))
    finally:
        llm.engine.shutdown()


def test_the_flags_and_what_is_refused(tmp_path):
    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = p.parse_args(["--model", str(tmp_path), "--tensor-parallel-size", "4", "--data-parallel-size", "4",
                         "--enable-dp-attention", "--expert-parallel", "--load-balance-method", "round_robin"])
    c = engine_config(args)
    assert (c.tensor_parallel_size, c.data_parallel_size, c.enable_dp_attention, c.expert_parallel) == (4, 4, True, True)
    assert (c.load_balance_method, c.load_balance_threshold) == ("round_robin", 4)
    with pytest.raises(ValueError, match="load_balance_method must be one of prefix, shortest_queue, round_robin"):
        EngineConfig(model="m", load_balance_method="random")
    with pytest.raises(ValueError, match="needs enable_dp_attention"):
        EngineConfig(model="m", tensor_parallel_size=2, data_parallel_size=2)
    with pytest.raises(ValueError, match="data_parallel_size of at least 2 that divides tensor_parallel_size"):
        EngineConfig(model="m", tensor_parallel_size=4, data_parallel_size=3, enable_dp_attention=True)
    assert EngineConfig(model="m", tensor_parallel_size=4, data_parallel_size=2, enable_dp_attention=True).attention_tp_size == 2
    c = EngineConfig(model="m", tensor_parallel_size=2, data_parallel_size=2, enable_dp_attention=True,
                     warmup=True, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert c.warmup and c.speculative_config.num_speculative_tokens == 2


def test_a_killed_rank_fails_the_engine_naming_it(dp2):
    (worker,) = dp2.engine.workers.procs
    os.kill(worker.pid, signal.SIGKILL)
    with pytest.raises(EngineDeadError, match=r"tensor-parallel rank 1 died \(exit code -9\)"):
        within(10, lambda: dp2.generate([list(range(10, 60)), list(range(20, 70))], PARAMS))
    dp2.engine.shutdown()
    assert worker.poll() is not None
