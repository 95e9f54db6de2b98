"""A tiny random DeepSeek-V4.1 (CSA2 at ratios 1 and 2 beside V4's sliding, CSA and HCA layers;
entries and index keys shared from KV sources; Reuse and Reindex layers; the candidate filter; a
CSA2 group with no indexer) against its own one-shot prefill, in fp32: chunked prefill cut at any
offset, any page size, any batch composition, prefix hits and preemption give the same logits and
greedy tokens. HF transformers has no V4.1; the mechanisms are pinned one by one in
tests/core/native/test_csa2.py."""

from __future__ import annotations

import random
from typing import Callable

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.config import EngineConfig
from engine.core.startup import build
from dsv41_random import random_v41_checkpoint, v41_config
from greedy_agreement import GreedyAgreement, compare_greedy, top2
from near_ties import indexer_near_ties
from packed_logits import engine_logits, rel_err

# layers: sliding; CSA2 ratio 2 (KV and index source, then Reuse); V4 CSA; CSA2 ratio 1 (KV, index and
# candidate source; Reuse; Reindex inside the candidates); V4 HCA; ratio 1 Reuse of the Reindex
# layer's picks; CSA2 ratio 2 with no indexer (every visible entry), then Reuse. Engram (3-grams)
# before layers 0 and 5
TINY = dict(ratios=[0, 2, 2, 4, 1, 1, 1, 128, 1, 2, 2], kv_sources=[1, 4, 9], index_sources=[1, 4, 6], candidate=4,
            blocks=3, block_size=2, window=8, top_k=4, engram=[0, 5])
DRAWS = 4
BOUND = 1e-4  # relative to the largest logit: fp32, sums in another order


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, run_seed, shared_dir):
    # tiny-dsv4-py's tokenizer: Engram's compression table, and detokenizing (ids under 128 are its tokens too)
    return random_v41_checkpoint(tmp_path_factory.mktemp("v41"), run_seed, v41_config(**TINY),
                                 shared_dir / "models" / "tiny-dsv4-py")


def prompts_for(rng: random.Random, lengths: list[int]) -> list[list[int]]:
    return [[rng.randrange(128) for _ in range(n)] for n in lengths]


def agree(c, page_size: int, draw: Callable[[], list[list[int]]],
          other: Callable[[list[list[int]]], list[torch.Tensor]]) -> None:
    """``other``'s logits of the prompts ``draw`` makes against one packed one-shot prefill of them.
    A draw that misses and whose indexer met a near tie (either pick right) is drawn again."""
    for _ in range(DRAWS):
        prompts = draw()
        with indexer_near_ties() as ties:
            want = engine_logits(c, prompts, page_size)
            got = other(prompts)
        worst = max(rel_err(g, w) for g, w in zip(got, want))
        if worst < BOUND:
            return
        assert ties, f"relative error {worst:.2e} with no indexer near tie"
    pytest.fail(f"each of {DRAWS} draws met an indexer near tie that moved the logits")


@pytest.mark.parametrize("page_size", [3, 4, 16])
def test_chunked_prefill_at_any_offset_gives_the_one_shot_logits(tiny, seed, page_size):
    rng = random.Random(seed)
    c = build(EngineConfig(model=str(tiny), dtype="float32", page_size=page_size, num_pages=200), progress=False)
    agree(c, page_size, lambda: prompts_for(rng, [1, rng.randint(2, 20), rng.randint(21, 70), 80]),
          lambda prompts: engine_logits(c, prompts, page_size, split=rng.uniform(0.05, 0.95)))


def test_batch_composition_does_not_change_the_logits(tiny, seed):
    rng = random.Random(seed)
    c = build(EngineConfig(model=str(tiny), dtype="float32", page_size=4, num_pages=200), progress=False)

    def alone_and_reordered(prompts):
        order = rng.sample(range(len(prompts)), len(prompts))
        reordered = engine_logits(c, [prompts[i] for i in order], 4)
        shuffled = [reordered[order.index(i)] for i in range(len(prompts))]
        alone = [engine_logits(c, [p], 4)[0] for p in prompts]
        return [a if rng.random() < 0.5 else s for a, s in zip(alone, shuffled)]

    agree(c, 4, lambda: prompts_for(rng, [rng.randint(1, 9), rng.randint(10, 40), 64]), alone_and_reordered)


def _one_shot_greedy(c, prompts: list[list[int]], got: list[list[int]], n: int) -> None:
    """Each of ``got`` is the one-shot prefill's ``n``-token greedy continuation, as far as its margins
    decide it (logits agree to ``BOUND``: the tests above)."""
    agreement = GreedyAgreement()
    for prompt, tokens in zip(prompts, got, strict=True):
        seq, scores = list(prompt), []
        for _ in range(n):
            scores.append(top2(engine_logits(c, [seq], 4)[0][-1]))
            seq.append(max(scores[-1], key=scores[-1].get))
        agreement += compare_greedy(seq[len(prompt):], scores, tokens, bound=2e-3)
    agreement.assert_most_sure()


@pytest.mark.parametrize("chunk", [1, 5, 0])
def test_greedy_over_chunks_and_prefix_hits_is_the_one_shot_one(tiny, seed, chunk):
    rng = random.Random(seed)
    base = [rng.randrange(128) for _ in range(23)]  # shared pages of 4, ending inside a pair and a block
    prompts = [base + [rng.randrange(128) for _ in range(n)] for n in (3, 11, 18)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    llm = LLM(str(tiny), dtype="float32", progress=False, page_size=4, chunked_prefill_size=chunk,
              enable_prefix_caching=True)
    first = llm.generate(prompts[:1], params)[0].outputs[0].token_ids  # its pages then serve prefix hits
    outs = llm.generate(prompts, params)
    assert all(o.num_cached_tokens >= 20 for o in outs)
    got = [o.outputs[0].token_ids for o in outs]
    assert got[0] == first
    c = build(EngineConfig(model=str(tiny), dtype="float32", page_size=4, num_pages=200), progress=False)
    _one_shot_greedy(c, prompts, got, params.max_tokens)


def test_greedy_under_preemption_is_the_one_shot_one(tiny, seed):
    """Too few pages for the whole batch: sequences are preempted and recomputed, tokens unchanged."""
    rng = random.Random(seed)
    prompts = prompts_for(rng, [9, 17, 30, 23])
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    llm = LLM(str(tiny), dtype="float32", progress=False, page_size=4, num_pages=24, enable_prefix_caching=False)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert llm.engine.stats().num_preemptions > 0
    c = build(EngineConfig(model=str(tiny), dtype="float32", page_size=4, num_pages=200), progress=False)
    _one_shot_greedy(c, prompts, got, params.max_tokens)


def test_each_layer_attends_to_the_picks_its_role_names(tiny, seed, monkeypatch):
    """Reuse layers get their index source's picks, the Reindex layer selects inside the candidate
    source's blocks, a CSA2 group without an indexer and V4's HCA attend every visible entry."""
    c = build(EngineConfig(model=str(tiny), dtype="float32", page_size=4, num_pages=64), progress=False)
    layer_of = {id(layer.attn.spec()): i for i, layer in enumerate(c.model.model.layers)}
    native, seen = type(c.model.model.attention), {}
    attend, select, candidates = native.attend, native.select, native.select_candidates

    def recording_attend(self, q, layer, kv, batch, meta, picks=None):
        seen["attend", layer_of[id(layer)]] = picks
        return attend(self, q, layer, kv, batch, meta, picks)

    def recording_select(self, q, weights, layer, kv, batch, meta, candidates=None):
        seen["select", layer_of[id(layer)]] = out = select(self, q, weights, layer, kv, batch, meta, candidates)
        seen["filter", layer_of[id(layer)]] = candidates
        return out

    def recording_candidates(self, q, weights, layer, kv, batch, meta):
        seen["candidates", layer_of[id(layer)]] = out = candidates(self, q, weights, layer, kv, batch, meta)
        return out

    monkeypatch.setattr(native, "attend", recording_attend)
    monkeypatch.setattr(native, "select", recording_select)
    monkeypatch.setattr(native, "select_candidates", recording_candidates)
    rng = random.Random(seed)
    engine_logits(c, prompts_for(rng, [rng.randint(1, 30), 50]), 4)
    for layer, index_source in {1: 1, 2: 1, 3: 3, 4: 4, 5: 4, 6: 6, 8: 6}.items():
        assert seen["attend", layer] is seen["select", index_source], layer
    assert all(seen["attend", layer] is None for layer in (0, 7, 9, 10))
    assert seen["filter", 6] is seen["candidates", 4] and seen["filter", 4] is seen["filter", 1] is None
    assert {k for k in seen if k[0] == "candidates"} == {("candidates", 4)}


def test_engram_reads_each_tokens_ngram_from_the_cache_across_chunks(tiny, seed, monkeypatch):
    """The n-gram ids Engram hashes in a step that resumes after cached context: each token's
    compressed id and the two before it, pad before the first."""
    c = build(EngineConfig(model=str(tiny), dtype="float32", page_size=3, num_pages=64), progress=False)
    history = c.model.model.ngrams
    table, pad, seen = history.table, history.pad, []
    forward = type(history).forward
    monkeypatch.setattr(type(history), "forward", lambda self, batch, kv: seen.append(forward(self, batch, kv))
                        or seen[-1])
    rng = random.Random(seed)
    prompts = prompts_for(rng, [rng.randint(1, 6), rng.randint(7, 40)])
    split = rng.uniform(0.2, 0.8)
    engine_logits(c, prompts, 3, split)
    cuts = [int(len(p) * split) for p in prompts]
    rows = [(p, pos) for p, cut in zip(prompts, cuts) for pos in range(cut)]
    rows += [(p, pos) for p, cut in zip(prompts, cuts) for pos in range(cut, len(p))]
    want = [[int(table[p[pos - k]]) if pos >= k else pad for k in range(3)] for p, pos in rows]
    assert torch.cat(seen).tolist() == want


def test_speculative_decoding_rolls_back_to_the_one_shot_greedy(tiny, seed):
    """n-gram drafts verified and the rejected ones rolled back (pairs, entries, index keys and the
    n-gram ids they wrote included): the greedy tokens are the one-shot prefill's."""
    rng = random.Random(seed)
    passages = prompts_for(rng, [rng.randint(8, 20) for _ in range(3)])
    prompts = [p + p + p[:rng.randint(2, len(p) - 1)] for p in passages]  # repetitive: the proposer drafts
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    llm = LLM(str(tiny), dtype="float32", progress=False, page_size=4, chunked_prefill_size=16,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                  "prompt_lookup_max": 3})
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    spec = llm.engine.stats().spec
    assert spec.num_draft_tokens > spec.num_accepted_tokens  # some rejected, so rolled back
    c = build(EngineConfig(model=str(tiny), dtype="float32", page_size=4, num_pages=200), progress=False)
    _one_shot_greedy(c, prompts, got, params.max_tokens)
