"""Drafts under a grammar (core/structured/drafts.py), against fresh xgrammar matchers on
tiny-qwen3-py's vocabulary: the drafts kept are the longest prefix the grammar accepts; each verify
row's mask is that of a matcher fed the drafts before it; the matcher ends as it began, also where a
stop token is drafted; and verify rows are masked only where a grammar is."""

from __future__ import annotations

import random

import pytest
import torch

from engine.core.structured.bitmask import allow_all, unpack
from engine.core.structured.compiler import GrammarCompiler
from engine.core.structured.drafts import accepted_prefix, fill_draft_bitmasks, mask_verify_rows
from engine.core.structured.params import StructuredOutputsParams as S
from engine.core.tokenizer import Tokenizer

pytest.importorskip("xgrammar")

VOCAB = 4096
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3):
    return Tokenizer.from_dir(tiny_qwen3)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    c = GrammarCompiler(tokenizer, VOCAB, timeout_s=30.0, cache_bytes=256 * 2**20)
    yield c
    c.shutdown()


def fresh(compiler, params: S, tokens: list[int]):
    """A new matcher fed ``tokens`` (each accepted)."""
    m = compiler.matcher(compiler.request(params).wait())
    assert all(m.accept_token(t) for t in tokens)
    return m


def mask_of(matcher) -> list[int]:
    host = allow_all(1, VOCAB, CPU)
    if not matcher.is_terminated():
        matcher.fill_next_token_bitmask(host, 0)
    return host[0].tolist()


def history(matcher) -> str:
    return matcher._debug_print_internal_state().splitlines()[0]


def case(tokenizer, rng: random.Random) -> tuple[S, list[int], list[int]]:
    """A grammar, the tokens on the host, and drafts: the valid text's next tokens, a third of the
    time all of them and the stop token, else perhaps one replaced by a random token, and cut."""
    words = ["".join(rng.choice("abcxyz") for _ in range(rng.randint(2, 6))) for _ in range(rng.randint(3, 6))]
    text = " ".join(words) + "."
    params = rng.choice([S(regex=r"[a-z]+( [a-z]+){0,8}\."), S(choice=[text, words[0] + "!"]),
                         S(json={"type": "object", "properties": {"w": {"type": "string"}}, "required": ["w"]})])
    if params.json is not None:
        text = '{"w": "%s"}' % text
    ids = tokenizer.encode(text)
    cut = rng.randrange(1, len(ids))
    drafts = ids[cut:] + [min(tokenizer.eos_token_ids)]
    if rng.random() < 1 / 3:
        return params, ids[:cut], drafts
    if rng.random() < 0.6:
        drafts[rng.randrange(len(drafts))] = rng.randrange(VOCAB)
    return params, ids[:cut], drafts[:rng.randint(1, len(drafts))]


def test_drafts_end_before_the_first_the_grammar_refuses_and_each_row_is_masked_by_the_drafts_before_it(
        compiler, tokenizer, seed):
    rng = random.Random(seed)
    ended, cut, whole = 0, 0, 0
    for _ in range(40):
        params, host, drafts = case(tokenizer, rng)
        m = fresh(compiler, params, host)
        before = (mask_of(m), history(m))
        n = accepted_prefix(m, drafts)
        assert (mask_of(m), history(m)) == before
        probe = fresh(compiler, params, host)
        want = next((j for j, t in enumerate(drafts) if not probe.accept_token(t)), len(drafts))
        assert n == want
        cut, whole = cut + (0 < n < len(drafts)), whole + (n == len(drafts))
        kept = drafts[:n]
        rows = allow_all(n + 3, VOCAB, CPU)
        fill_draft_bitmasks(m, kept, rows, 2)
        assert (mask_of(m), history(m)) == before
        for j in range(n + 1):
            assert rows[2 + j].tolist() == mask_of(fresh(compiler, params, host + kept[:j])), j
        assert rows[:2].eq(-1).all()
        ended += fresh(compiler, params, host + kept).is_terminated()
    assert cut and whole
    assert ended  # some drafts reached the stop token: the row after it allows every token


def test_a_draft_the_grammar_refuses_is_an_error_and_leaves_the_matcher_as_it_was(compiler, tokenizer):
    params = S(regex=r"[a-z]{2,9}\.")
    ids = tokenizer.encode("abcdef.")
    m = fresh(compiler, params, [])
    before = history(m)
    with pytest.raises(ValueError, match="grammar"):
        fill_draft_bitmasks(m, ids + ids, allow_all(2 * len(ids) + 1, VOCAB, CPU), 0)
    assert history(m) == before


def test_only_the_rows_of_sequences_with_a_grammar_are_masked(compiler, tokenizer, seed):
    rng = random.Random(seed)
    params = S(regex=r"[a-z]{1,6}( [a-z]{1,6}){0,5}")
    host, drafts = tokenizer.encode("ab"), tokenizer.encode(" cd ef")
    logits = torch.randn(10, VOCAB)
    first = rng.randrange(0, 10 - len(drafts))
    out = mask_verify_rows(logits, [(fresh(compiler, params, host), drafts, first)])
    rows = range(first, first + len(drafts) + 1)
    for i in range(10):
        if i not in rows:
            assert torch.equal(out[i], logits[i])
    for j, i in enumerate(rows):
        words = torch.tensor([mask_of(fresh(compiler, params, host + drafts[:j]))], dtype=torch.int32)
        allowed = unpack(words, VOCAB)[0]
        assert not allowed.all()
        assert torch.equal(out[i][allowed], logits[i][allowed]) and out[i][~allowed].eq(float("-inf")).all()
