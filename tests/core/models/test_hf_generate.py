"""Greedy generation token-identical to HF ``generate``, whatever the scheduling."""

from __future__ import annotations

import random

import pytest
import torch

transformers = pytest.importorskip("transformers")

from engine import LLM, SamplingParams
from engine.core.tokenizer import Tokenizer
from greedy_agreement import GreedyAgreement, compare_greedy, top2

MAX_NEW = 20
# HF's min_new_tokens keeps EOS out of the argmax; min_tokens does the same here (ignore_eos alone
# would let the tiny model's EOS through as a token, where HF takes its runner-up)
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, min_tokens=MAX_NEW, ignore_eos=True)
BOUND = 1e-3  # on logits: the engine's agree with HF's to 1e-4 of the largest (test_hf_logits.py)


@pytest.fixture(scope="module")
def prompts(tiny_qwen3, eval_text, run_seed) -> list[list[int]]:
    """8 prompts of different lengths; half share a 40-token prefix so the prefix cache hits."""
    ids = Tokenizer.from_dir(tiny_qwen3).encode(eval_text)
    rng = random.Random(run_seed)
    shared = ids[:40]
    out = []
    for i in range(8):
        start = rng.randrange(100, len(ids) - 200)
        body = ids[start:start + rng.randint(1, 120)]
        out.append(shared + body if i % 2 else body)
    return out


@pytest.fixture(scope="module")
def reference(tiny_qwen3, prompts) -> list[tuple[list[int], list[dict[int, float]]]]:
    """HF's greedy tokens of each prompt, with the top-2 scores of every step."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32)
    refs = []
    with torch.no_grad():
        for p in prompts:
            out = hf.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False,
                              output_scores=True, return_dict_in_generate=True)
            refs.append((out.sequences[0, len(p):].tolist(), [top2(s[0]) for s in out.scores]))
    return refs


def assert_matches(outs, reference) -> None:
    agreement = GreedyAgreement()
    for out, (tokens, scores) in zip(outs, reference, strict=True):
        agreement += compare_greedy(tokens, scores, out.outputs[0].token_ids, bound=BOUND)
    agreement.assert_most_sure()


@pytest.mark.parametrize("chunk", [7, 64, None])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_greedy_matches_hf(tiny_qwen3, prompts, reference, chunk, prefix_caching):
    llm = LLM(str(tiny_qwen3), dtype="float32", page_size=4, chunked_prefill_size=chunk,
              enable_prefix_caching=prefix_caching, progress=False)
    # run the batch twice: the second pass hits the prefix cache for every prompt
    for _ in range(2):
        outs = llm.generate(prompts, GREEDY)
        assert_matches(outs, reference)
    assert (llm.engine.kv_manager.stats().prefix_hits > 0) == prefix_caching


def test_greedy_matches_hf_under_preemption(tiny_qwen3, prompts, reference):
    longest = max(len(p) for p in prompts) + MAX_NEW
    pages = -(-longest // 4) + 8  # one long sequence fits; eight at once do not
    llm = LLM(str(tiny_qwen3), dtype="float32", page_size=4, num_pages=pages, chunked_prefill_size=16,
              progress=False)
    outs = llm.generate(prompts, GREEDY)
    assert llm.engine.scheduler.stats.num_preemptions > 0
    assert_matches(outs, reference)
    kv = llm.engine.kv_manager
    kv.check_consistency()
    assert kv.stats().num_free + kv.stats().num_cached == kv.stats().num_usable
