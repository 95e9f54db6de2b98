"""MTP with attention split over processes: tiny-dsv4-py with the next-n layer trained for it
(tests/assets/tiny-dsv4-py-mtp) over gloo, as tensor-parallel ranks (2 processes) and as 2
data-parallel ranks with attention tensor-parallel over 2 each (4 processes, the experts split).
Each attention group's processes run the layer's drafting forwards together, each its own heads,
from the streams of the process that schedules: greedy tokens of one process without speculation
through chunked prefill and a prefix hit, the drafts one speculating process proposes, kept as
often; every KV page back, the layer's too."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from engine import LLM, SamplingParams

from tp_helpers import DSV4_OPTS, TIMEOUT_S, within

ASSETS = Path(__file__).parents[2] / "assets"
OPTS = {k: v for k, v in DSV4_OPTS.items() if k != "num_pages"}
SPEC = {"method": "mtp", "num_speculative_tokens": 3, "model": str(ASSETS / "tiny-dsv4-py-mtp")}


def tokens(llm: LLM, batch: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in within(TIMEOUT_S, lambda: llm.generate(batch, params))]


@pytest.mark.parametrize("tp, dp", [(2, 1), (4, 2)], ids=["tp2", "dp2-attention-tp2"])
def test_greedy_tokens_and_drafts_of_one_process(tp, dp, single, dsv4, eval_text, seed):
    rng = random.Random(seed)
    batch = []
    for _ in range(2):  # a passage past the 32-token chunk, then its start again: drafts kept, and rejected
        start = rng.randrange(len(eval_text) - 2000)
        passage = single.tokenizer.encode(eval_text[start:start + 2000])[:rng.randint(28, 36)]
        batch.append(passage + passage[:rng.randint(8, 14)])
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(8, 12), ignore_eos=True) for _ in batch]
    want = tokens(single, batch, params)
    one = LLM(dsv4, speculative_config=SPEC, **DSV4_OPTS)
    assert tokens(one, batch, params) == want
    llm = within(TIMEOUT_S, lambda: LLM(dsv4, num_pages=128, tensor_parallel_size=tp, data_parallel_size=dp,
                                        enable_dp_attention=dp > 1, speculative_config=SPEC,
                                        distributed_timeout=TIMEOUT_S, **OPTS))
    try:
        assert tokens(llm, batch, params) == want
        engine = llm.engine
        drafted = engine.stats().spec
        assert drafted == one.engine.stats().spec  # every process's heads gave the one process's drafts
        assert 0 < drafted.num_accepted_tokens < drafted.num_draft_tokens
        # the first prompt again: a prefix hit (on rank 0, where it went), drafted for after it
        hits = engine.kv_manager.stats().prefix_hits
        assert tokens(llm, batch[:1], params[:1]) == want[:1]
        s = engine.stats()
        assert engine.kv_manager.stats().prefix_hits > hits and s.spec.num_draft_tokens > drafted.num_draft_tokens
        assert s.num_running == s.num_waiting == 0 and s.kv_usage == 0 and not engine.has_unfinished_requests()
        engine.kv_manager.check_consistency()
        proposer = engine.speculator.proposer
        assert not proposer._seqs and proposer.kv.stats().usage == 0
    finally:
        llm.engine.shutdown()
