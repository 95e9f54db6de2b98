"""Prefill graphs under expert parallelism end to end: tiny-dsv4-py on 2 processes over gloo, the
experts partitioned (all_to_all), on the recorded graphs backend (core/native/graphs.py; the
native MoE's expert calls are breaks inside the padded exchange), gives the greedy tokens of one
eager process through chunked prefill (steps of up to 32 tokens replay a graph, larger ones run
eagerly on every rank) and prefix hits, and every KV page comes back: with tensor-parallel
attention, and with data-parallel attention (each rank its own requests), where a rank's step
replays the larger bucket another rank needs and a rank idle while the other prefills replays the
agreed bucket on padding."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams

from tp_helpers import DSV4_OPTS, TIMEOUT_S, within

OPTS = {k: v for k, v in DSV4_OPTS.items() if k != "num_pages"}
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def tokens(llm: LLM, batch: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in within(TIMEOUT_S, lambda: llm.generate(batch, PARAMS))]


@pytest.mark.parametrize("dp", [1, 2], ids=["ep2", "dp2-ep2"])
def test_greedy_tokens_of_one_process_through_prefill_graphs(dp, single, dsv4, run_seed, monkeypatch):
    rng, vocab = random.Random(run_seed), single.engine.vocab_size
    # placed alternately: prompts 0, 2 (short: one step of at most 28 tokens) on rank 0, 1, 3 on rank 1
    # (two chunks of 32, then 20 to 32 tokens: bucket 32, while rank 0 decodes 2 sequences)
    batch = [[rng.randrange(3, vocab) for _ in range(rng.randint(10, 14) if i % 2 == 0 else rng.randint(42, 48))]
             for i in range(4)]
    llm = within(TIMEOUT_S, lambda: LLM(dsv4, num_pages=128, tensor_parallel_size=2, data_parallel_size=dp,
                                        enable_dp_attention=dp > 1, expert_parallel=True, graph_backend="recorded",
                                        max_prefill_graph_tokens=32, distributed_timeout=TIMEOUT_S, **OPTS))
    try:
        engine = llm.engine
        graphs = engine.runner.prefill_graphs
        assert graphs is not None and graphs.buckets == [16, 32]
        calls = []  # rank 0's replays: (tokens, bucket), or ("pad", bucket) while it idles
        run, pad = graphs.run, graphs.pad
        monkeypatch.setattr(graphs, "run", lambda batch, bucket=None: calls.append((batch.num_tokens, bucket))
                            or run(batch, bucket))
        monkeypatch.setattr(graphs, "pad", lambda bucket: calls.append(("pad", bucket)) or pad(bucket))
        expected = tokens(single, batch)
        assert tokens(llm, batch) == expected
        assert any(n != "pad" for n, _ in calls), "no step replayed a prefill graph"
        if dp > 1:
            assert any(n != "pad" and n <= 16 < b for n, b in calls), "no step took a larger bucket another needed"
        # each extended by its output: under DP attention to the rank that caches its prefix, the other idle
        for i in (1, 0):
            again = [batch[i] + expected[i] + [rng.randrange(3, vocab) for _ in range(rng.randint(5, 20))]]
            hits, calls[:] = engine.stats().prefix_cache_hits, []
            assert tokens(llm, again) == tokens(single, again)
            assert engine.stats().prefix_cache_hits > hits
            assert any(n == "pad" for n, _ in calls) == (dp > 1 and i == 1)  # rank 0 pads while rank 1 prefills
        s = engine.stats()
        assert s.num_running == s.num_waiting == 0 and s.kv_usage == 0 and not engine.has_unfinished_requests()
        engine.kv_manager.check_consistency()
    finally:
        llm.engine.shutdown()
