"""Tensor parallelism end to end: an engine of 2 processes over gloo gives the greedy tokens of one
process, through chunked prefill, prefix-cache hits and preemption. One 2-rank engine per module."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams

from tp_helpers import TIMEOUT_S, within

PAGE_SIZE = 4
OPTS = dict(dtype="float32", page_size=PAGE_SIZE, chunked_prefill_size=32, max_num_batched_tokens=64,
            max_num_seqs=8, enable_prefix_caching=True, progress=False)


@pytest.fixture(scope="module")
def single(tiny_qwen3) -> LLM:
    return LLM(tiny_qwen3, num_pages=512, **OPTS)


@pytest.fixture(scope="module")
def tp2(tiny_qwen3):
    # few pages: the batch below cannot all run at once, so sequences are preempted and recomputed
    llm = within(TIMEOUT_S, lambda: LLM(tiny_qwen3, num_pages=40, tensor_parallel_size=2,
                                        distributed_timeout=TIMEOUT_S, **OPTS))
    yield llm
    llm.engine.shutdown()


def prompts(llm: LLM, text: str, count: int) -> list[list[int]]:
    """Prompts of random lengths from random places in ``text``; every other one extends the one
    before it, so later ones can hit the prefix cache."""
    out: list[list[int]] = []
    for i in range(count):
        start = random.randrange(len(text) - 4000)
        ids = llm.tokenizer.encode(text[start: start + 4000])[: random.randint(20, 60)]
        out.append(out[-1] + ids[:random.randint(5, 15)] if i % 2 and out else ids)
    return out


def test_two_ranks_generate_what_one_process_does(single, tp2, eval_text, seed):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    batch = prompts(single, eval_text, 6)
    expected = [o.outputs[0].token_ids for o in single.generate(batch, params)]
    got = [o.outputs[0].token_ids for o in within(TIMEOUT_S, lambda: tp2.generate(batch, params))]
    assert got == expected
    stats = tp2.engine.stats()
    assert stats.num_preemptions > 0, "the batch was meant to run short of pages"
    # the same prompts again, extended by their outputs: what the few pages kept may hit
    again = [p + t for p, t in zip(batch, expected)]
    expected = [o.outputs[0].token_ids for o in single.generate(again, params)]
    got = [o.outputs[0].token_ids for o in within(TIMEOUT_S, lambda: tp2.generate(again, params))]
    assert got == expected
    # a prompt right after its own shorter run: its pages are the cache's newest, so it hits them on
    # every rank (the batch above hits only what its order leaves: none at some seeds)
    hits = tp2.engine.stats().prefix_cache_hits
    assert [o.outputs[0].token_ids for o in tp2.generate([again[-1]], params)] == expected[-1:]
    longer = again[-1] + expected[-1]
    want = single.generate([longer], params)[0].outputs[0].token_ids
    assert within(TIMEOUT_S, lambda: tp2.generate([longer], params))[0].outputs[0].token_ids == want
    assert tp2.engine.stats().prefix_cache_hits > hits


def test_each_rank_holds_half_of_the_heads_and_vocabulary(single, tp2):
    whole, half = single.engine.components.model, tp2.engine.components.model
    attn, attn2 = whole.model.layers[0].self_attn, half.model.layers[0].self_attn
    assert (attn2.num_heads, attn2.num_kv_heads) == (attn.num_heads // 2, attn.num_kv_heads // 2)
    assert half.model.embed_tokens.weight.shape[0] == whole.model.embed_tokens.weight.shape[0] // 2
    assert half.model.layers[0].mlp.down_proj.weight.shape[1] == whole.model.layers[0].mlp.down_proj.weight.shape[1] // 2
    # rank 0 holds the first half of the rows, as read from the checkpoint
    assert half.model.embed_tokens.weight.equal(whole.model.embed_tokens.weight[: half.model.embed_tokens.weight.shape[0]])


def test_a_host_cache_tier_is_refused_under_tensor_parallelism(tiny_qwen3):
    with pytest.raises(ValueError, match="enable_hierarchical_cache with tensor_parallel_size > 1"):
        LLM(tiny_qwen3, tensor_parallel_size=2, enable_hierarchical_cache=True, progress=False)
