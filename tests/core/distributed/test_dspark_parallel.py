"""DSpark over several processes on gloo. Under tensor parallelism (2 processes, tiny-dsv4-py's heads
and vocabulary split) rank 0 drafts with the trained drafter (tests/assets/tiny-dsv4-py-dspark) from
the target's whole features, with whole copies of the embedding and LM head, and verifies: the
greedy tokens of one process, as many drafts proposed and kept as one speculating process, the
verify step timed at start-up on both ranks, every page back. Under data-parallel attention (2
processes, experts partitioned) a tiny random DeepSeek-V4.1's own DSpark stages, whose MoE spans
both ranks, draft each rank's requests in lockstep: the greedy tokens of one process. With the
attention split over processes (2 tensor-parallel processes; 2 data-parallel ranks of 2 each) every
process of an attention group runs each block of the stages from the scheduling one's context rows:
the drafts of one process, step by step, the greedy tokens of one process without speculation."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from engine.core.spec.verify_length import LoadAwareLength, StepCurve

from drafts_spy import Drafts
from dsv41_random import random_v41_checkpoint, v41_config
from test_dp_speculative import ASSETS, OPTS, repetitive, tokens
from tp_helpers import DSV4_OPTS, TIMEOUT_S, within

K = 3
TRAINED = {"method": "dspark", "num_speculative_tokens": K, "model": str(ASSETS / "tiny-dsv4-py-dspark")}
STAGES = {"method": "dspark", "num_speculative_tokens": K}
V41 = dict(ratios=[0, 2, 1], kv_sources=[1, 2], index_sources=[1, 2], dspark=[1, 2])


def every_draft_verified(llm: LLM) -> LLM:
    """Every step costs the same: the verify length keeps every draft, whatever the timing."""
    llm.engine.speculator.verify_length = LoadAwareLength(StepCurve((1, 64), (1.0, 1.0)), K)
    return llm


def assert_clean(llm: LLM) -> None:
    engine = llm.engine
    s = engine.stats()
    assert s.num_running == s.num_waiting == 0 and s.kv_usage == 0 and not engine.has_unfinished_requests()
    engine.kv_manager.check_consistency()
    assert not engine.speculator.proposer._contexts


def test_tensor_parallel_drafts_on_rank_0_as_one_process(single, dsv4, eval_text, run_seed):
    llm = within(TIMEOUT_S, lambda: LLM(dsv4, num_pages=128, tensor_parallel_size=2, speculative_config=TRAINED,
                                        distributed_timeout=TIMEOUT_S, **OPTS))
    try:
        one = LLM(dsv4, speculative_config=TRAINED, **DSV4_OPTS)
        # the verify step timed at start-up on both ranks (rank 1 ran each timed step rank 0 sent it)
        assert llm.engine.speculator.verify_length.curve.tokens == one.engine.speculator.verify_length.curve.tokens
        every_draft_verified(llm), every_draft_verified(one)
        rng = random.Random(run_seed)
        batch = [repetitive(single, eval_text, rng) for _ in range(3)]
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        want = tokens(single, batch, params)
        assert tokens(llm, batch, params) == want == tokens(one, batch, params)
        spec = llm.engine.stats().spec
        assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens, "drafts both kept and rejected"
        assert spec == one.engine.stats().spec
        assert tokens(llm, batch[:1], params) == want[:1]  # a prefix hit, drafted from its end on
        assert llm.engine.stats().spec.num_draft_tokens > spec.num_draft_tokens
        assert llm.engine.kv_manager.stats().prefix_hits > 0
        assert_clean(llm)
    finally:
        llm.engine.shutdown()


@pytest.fixture(scope="module")
def v41(tmp_path_factory, run_seed, shared_dir):
    return random_v41_checkpoint(tmp_path_factory.mktemp("v41-dspark-dp"), run_seed, v41_config(**V41),
                                 shared_dir / "models" / "tiny-dsv4-py")


def test_stages_under_data_parallel_attention_draft_in_lockstep(v41):
    opts = dict(dtype="float32", page_size=4, num_pages=64, chunked_prefill_size=8, max_num_seqs=4, progress=False)
    plain = LLM(str(v41), **opts)
    llm = within(TIMEOUT_S, lambda: LLM(str(v41), tensor_parallel_size=2, data_parallel_size=2,
                                        enable_dp_attention=True, expert_parallel=True, speculative_config=STAGES,
                                        distributed_timeout=TIMEOUT_S, **opts))
    try:
        every_draft_verified(llm)  # rank 0's; rank 1 keeps its timed curve
        rng = random.Random()
        # three prompts, placed alternately: rank 0 drafts two, rank 1 one, so one idles through the other's
        batch = [[rng.randrange(4, 128) for _ in range(rng.randint(9, 20))] for _ in range(3)]
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (10, 6, 3)]
        assert tokens(llm, batch, params) == tokens(plain, batch, params)
        own, both = llm.engine.speculator.counters, llm.engine.stats().spec
        assert 0 < own.num_draft_tokens < both.num_draft_tokens, "both ranks drafted"
        assert_clean(llm)
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("tp, dp", [(2, 1), (4, 2)], ids=["tp2", "dp2-attention-tp2"])
def test_stages_under_attention_split_over_processes_draft_as_one_process(tp, dp, v41):
    """Every process of an attention group runs each block of the stages, its heads and slices, from
    the context rows of the process that schedules: the drafts of one process, step by step."""
    opts = dict(dtype="float32", page_size=4, num_pages=64, chunked_prefill_size=8, max_num_seqs=4, progress=False)
    plain, one = LLM(str(v41), **opts), every_draft_verified(LLM(str(v41), speculative_config=STAGES, **opts))
    llm = within(TIMEOUT_S, lambda: LLM(str(v41), tensor_parallel_size=tp, data_parallel_size=dp,
                                        enable_dp_attention=dp > 1, speculative_config=STAGES,
                                        distributed_timeout=TIMEOUT_S, **opts))
    try:
        every_draft_verified(llm)  # rank 0's; under DP attention rank 1 keeps its timed curve
        rng = random.Random()
        batch = [[rng.randrange(4, 128) for _ in range(rng.randint(9, 20))] for _ in range(3)]
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (10, 6, 3)]
        with Drafts(llm.engine) as split, Drafts(one.engine) as whole:
            assert tokens(llm, batch, params) == tokens(plain, batch, params) == tokens(one, batch, params)
        # this attention group's sequences (under DP attention rank 0's: 0 and 2), drafted as alone
        assert split.by_seq and split.by_seq == {seq: whole.by_seq[seq] for seq in split.by_seq}
        assert llm.engine.speculator.counters.num_draft_tokens > 0
        if dp == 1:  # as many drafted and kept, at each position
            assert llm.engine.stats().spec == one.engine.stats().spec
        assert_clean(llm)
    finally:
        llm.engine.shutdown()
