"""The n-gram proposer: prompt lookup against a brute-force search, and its registration through
the spec family as the native plugin's descriptor (what ``engine plugins`` lists)."""

from __future__ import annotations

import random

import pytest

from engine import LLM
from engine.core.config import EngineConfig
from engine.core.families.spec import DraftRequest
from engine.core.plugins import CPU_PLATFORM, load_plugins
from engine.core.plugins_report import report
from engine.core.registry import SelectionContext
from engine.core.spec.config import SpecConfigError
from engine.core.spec.ngram import NgramProposer, lookup


def brute_force(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Every suffix length from the longest, every earlier start from the latest."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def test_lookup_equals_a_brute_force_search(seed):
    found = 0
    for _ in range(3000):
        vocab = random.randint(2, 12)
        tokens = [random.randrange(vocab) for _ in range(random.randint(1, 40))]
        lo = random.randint(1, 4)
        hi = random.randint(lo, 6)
        k = random.randint(0, 6)
        want = brute_force(tokens, lo, hi, k)
        assert lookup(tokens, lo, hi, k) == want, (tokens, lo, hi, k)
        found += bool(want)
    assert found > 500  # the cases that draft are many, not a corner


def test_lookup_takes_the_longest_suffix_then_the_latest_occurrence():
    #            0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [7, 8, 9, 1, 5, 8, 9, 2, 3, 7, 8, 9]
    assert lookup(tokens, 1, 3, 2) == [1, 5]  # "7 8 9" at 0 beats the later "8 9" at 5
    assert lookup(tokens, 1, 2, 2) == [2, 3]  # at most 2: "8 9", its latest occurrence
    assert lookup(tokens, 4, 5, 2) == []  # no 4-token suffix occurred before
    assert lookup([4, 4, 4], 1, 3, 5) == [4]  # what follows runs out at the end
    assert lookup([1, 2, 3], 1, 3, 3) == [] and lookup([3], 1, 1, 3) == []


def ctx(**spec) -> SelectionContext:
    config = EngineConfig(model="m", speculative_config={"method": "ngram", "num_speculative_tokens": 3, **spec})
    return SelectionContext(platform=CPU_PLATFORM, engine_config=config)


def test_ngram_is_the_native_plugins_proposer_and_engine_plugins_lists_it():
    plugins = load_plugins()
    (ngram,) = [d for d in plugins.descriptors("spec") if d.name == "ngram"]
    assert ngram.plugin == "native"
    proposer = plugins.select("spec", ctx(prompt_lookup_min=2, prompt_lookup_max=3), "ngram").create(
        ctx(prompt_lookup_min=2, prompt_lookup_max=3))
    assert isinstance(proposer, NgramProposer) and (proposer.min_n, proposer.max_n) == (2, 3)
    requests = [DraftRequest(0, [5, 6, 7, 5, 6], 3), DraftRequest(1, [5, 6, 7, 5, 6], 1), DraftRequest(2, [1, 2], 3)]
    drafts = proposer.propose(requests)
    drafts.check(requests)
    assert drafts.token_ids == [[7, 5, 6], [7], []] and drafts.probs is None

    text = report(plugins, SelectionContext(platform=CPU_PLATFORM))
    assert ("spec: off (--speculative-config names a proposer as its method); registered: draft_model, dspark, mtp, "
            "ngram") in text
    text = report(plugins, ctx(), ctx().engine_config.requested_backends())
    assert "spec (requested 'ngram'): selects ngram (plugin native)" in text


def test_ngram_refuses_a_drafter_checkpoint(tiny_qwen3):
    (ngram,) = [d for d in load_plugins().descriptors("spec") if d.name == "ngram"]
    assert ngram.check(ctx()) == [] and "speculative_config.model" in ngram.check(ctx(model="d"))[0]
    with pytest.raises(SpecConfigError, match="(?s)speculative_config.method: 'ngram' cannot run here.*loads no model"):
        LLM(str(tiny_qwen3), speculative_config={"method": "ngram", "num_speculative_tokens": 2, "model": "d"},
            progress=False)

