"""DeepSeek-V4 (tiny-dsv4-py) on 2 processes gives the greedy tokens of one process, with its
experts split over the ranks and with expert parallelism (each rank holds half the experts, tokens
dispatched with all_to_all), through chunked prefill and prefix-cache hits. One 2-rank engine at a
time: the module's fixture is parametrized."""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams

from tp_helpers import DSV4_OPTS, TIMEOUT_S, within

OPTS = DSV4_OPTS
PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def workload(single, run_seed) -> list[tuple[list[list[int]], list[list[int]]]]:
    """Two rounds of (prompts, one process's greedy tokens): prompts past the sliding window (64) and
    a compression window, then the same ones extended by their outputs and a few tokens more, which
    hit the prefix cache. Made once for both parallel engines."""
    rng, vocab = random.Random(run_seed), single.engine.vocab_size
    torch.set_num_threads(1)  # as the ranks will run: on a busy 2-core host spinning threads cost 10x
    batch = [[rng.randrange(3, vocab) for _ in range(rng.randint(66, 90))] for _ in range(3)]
    rounds = []
    for _ in range(2):
        expected = [o.outputs[0].token_ids for o in single.generate(batch, PARAMS)]
        rounds.append((batch, expected))
        batch = [p + out + [rng.randrange(3, vocab) for _ in range(5)] for p, out in zip(batch, expected)]
    return rounds


@pytest.fixture(scope="module", params=[False, True], ids=["split-experts", "expert-parallel"])
def parallel(request, dsv4):
    llm = within(TIMEOUT_S, lambda: LLM(dsv4, tensor_parallel_size=2, expert_parallel=request.param,
                                        distributed_timeout=TIMEOUT_S, **OPTS))
    yield llm
    llm.engine.shutdown()


def test_two_ranks_generate_what_one_process_does(single, workload, parallel):
    for batch, expected in workload:
        got = [o.outputs[0].token_ids for o in within(TIMEOUT_S, lambda: parallel.generate(batch, PARAMS))]
        assert got == expected
    assert parallel.engine.stats().prefix_cache_hits > 0
    layer = parallel.engine.components.model.model.layers[2]
    whole = single.engine.components.model.model.layers[2]
    assert layer.attn.num_heads == whole.attn.num_heads // 2
    assert layer.attn.wkv.weight.shape == whole.attn.wkv.weight.shape  # the one KV head on every rank
    if parallel.engine.config.expert_parallel:
        assert layer.ffn.experts.gate_up.shape[0] == whole.ffn.num_experts // 2
    else:
        assert layer.ffn.experts.gate_up.shape[1] == whole.ffn.experts.gate_up.shape[1] // 2
