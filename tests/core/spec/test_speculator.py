"""The speculator's verification step gives the target's distribution at every position of a chain,
each position sampled as the sequence would be with the drafts before it drawn: a presence penalty
makes position j's target depend on the tokens before it, and many sequences verified in one step
give tokens tested against it by chi-square (one-hot drafts, as n-gram's, and drafts drawn from a
distribution the proposer hands over), under a grammar too, whose rows give the target with what the
grammar refuses after the drafts before them taken out. A speculator that forgot the drafts before a
row fails it."""

from __future__ import annotations

import random
from collections import defaultdict

import pytest
import torch

from engine.core.families.spec import Drafts, SpecProposer
from engine.core.kv.manager import SeqKV
from engine.core.sampler import Sampler
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import ScheduledSeq
from engine.core.sequence import Sequence
from engine.core.spec import speculator as speculator_module
from engine.core.spec.speculator import Speculator
from engine.core.token_table import TokenTable

from test_rejection import chi_square_p

VOCAB, K, SEQS, PENALTY, TEMPERATURE = 5, 2, 8000, 2.0, 0.8


class FixedDrafts(SpecProposer):
    """Drafts every sequence ``K`` tokens: one-hot (a fixed chain) or drawn from ``q`` [K, V]."""

    name = "fixed"

    def __init__(self, chain: list[int], q: torch.Tensor | None, generator: torch.Generator) -> None:
        super().__init__(None)
        self.chain, self.q, self.generator = chain, q, generator
        self.told: list[tuple[list[int], list[int]]] = []

    def propose(self, requests, features=None) -> Drafts:
        if self.q is None:
            return Drafts([list(self.chain) for _ in requests])
        ids = torch.stack([torch.multinomial(self.q[j], len(requests), replacement=True, generator=self.generator)
                           for j in range(K)], dim=1)
        return Drafts(ids.tolist(), self.q.repeat(len(requests), 1))

    def accepted(self, seq_ids, num_accepted) -> None:
        self.told.append((seq_ids, num_accepted))


class BanAfter:
    """A grammar over the test's vocabulary, in xgrammar's matcher calls: after token ``a`` it refuses
    ``ban[a]``, so what a row allows depends on the drafts before it. It starts after the output token 3."""

    def __init__(self, ban: dict[int, int]) -> None:
        self.ban, self.tokens = ban, [3]

    def accept_token(self, t: int) -> bool:
        if t == self.ban[self.tokens[-1]]:
            return False
        self.tokens.append(t)
        return True

    def rollback(self, n: int) -> None:
        del self.tokens[len(self.tokens) - n:]

    def is_terminated(self) -> bool:
        return False

    def fill_next_token_bitmask(self, mask: torch.Tensor, row: int) -> None:
        mask[row, 0] = ~(1 << self.ban[self.tokens[-1]])


class NoRollback:
    def rewind(self, seq, num_computed) -> None:
        pass


def target(logits: torch.Tensor, before: tuple[int, ...], ban: dict[int, int] | None = None) -> torch.Tensor:
    """What the target gives after ``before``: the presence penalty on every token drawn, then temperature;
    under a grammar ``ban``, without the token it refuses after the last of ``before``."""
    x = logits.clone()
    if ban is not None:
        x[ban[before[-1]]] = float("-inf")
    x[list(set(before))] -= PENALTY
    return (x / TEMPERATURE).softmax(dim=-1)


def verify_chains(logits: torch.Tensor, proposer: FixedDrafts, seed: int,
                  ban: dict[int, int] | None = None) -> tuple[list[list[int]], Speculator]:
    """``SEQS`` sequences with the same prompt and target logits [K + 1, V], their drafts verified in
    one step (each under the grammar ``ban``, if given): the tokens each gives."""
    sampler = Sampler(VOCAB, set(), TokenTable(4, "cpu"), seed=seed)
    spec = Speculator(proposer, K, sampler, VOCAB)
    params = SamplingParams(temperature=TEMPERATURE, presence_penalty=PENALTY, max_tokens=50)
    prompt = [0, 1, 2]
    seqs = [Sequence(i, f"r{i}", 0, prompt, params, output_token_ids=[3], max_output=50,
                     grammar=BanAfter(ban) if ban is not None else None) for i in range(SEQS)]
    drafts = spec.propose(seqs, SEQS * K)
    rows = [(ScheduledSeq(s, K + 1, len(prompt), SeqKV(), False, True, False, drafts[s.seq_id]), (K + 1) * i)
            for i, s in enumerate(seqs)]
    verified = spec.verify(rows, logits.repeat(SEQS, 1))
    order, kept = verified.resolve(NoRollback())
    chains = defaultdict(list)
    for seq, token in zip(order, kept.token_ids):
        chains[seq.seq_id].append(token)
    return [chains[s.seq_id] for s in seqs], spec


def p_values(chains: list[list[int]], logits: torch.Tensor, ban: dict[int, int] | None = None) -> list[float]:
    """Per position and per prefix that at least 200 chains reach, the chi-square p-value of the
    tokens given there against the target after that prefix (the sequence's output token 3 first)."""
    out = []
    for j in range(K + 1):
        groups = defaultdict(list)
        for c in chains:
            if len(c) > j:
                groups[tuple(c[:j])].append(c[j])
        tested = [(prefix, tokens) for prefix, tokens in groups.items() if len(tokens) >= 200]
        assert tested, f"no prefix reaches position {j} often enough"
        for prefix, tokens in tested:
            counts = torch.bincount(torch.tensor(tokens), minlength=VOCAB).double()
            out.append(chi_square_p(counts, target(logits[j], (3, *prefix), ban).double()))
    return out


def setting(seed: int, kind: str) -> tuple[torch.Tensor, FixedDrafts]:
    g = torch.Generator().manual_seed(seed)
    logits = 2 * torch.randn(K + 1, VOCAB, generator=g)  # peaked: chains often share a prefix
    logits[0, 3] = logits[0].min() - 1  # a first draft other than the output token 3, so its penalty matters
    chain = [int(logits[0].argmax()), 0]  # likely drafts (each at least 1 / VOCAB): chains reach every position
    logits[1:, chain[0]] = logits[1:].max(dim=-1).values
    chain[1] = int(target(logits[1], (3, chain[0])).argmax())
    q = None if kind == "one-hot" else (logits[:K] + 0.5 * torch.randn(K, VOCAB, generator=g)).softmax(dim=-1)
    return logits, FixedDrafts(chain, q, g)


@pytest.mark.parametrize("kind", ["one-hot", "distribution"])
def test_every_position_is_distributed_as_the_target_after_the_drafts_before_it(seed, kind):
    logits, proposer = setting(seed, kind)
    chains, spec = verify_chains(logits, proposer, seed)
    assert min(p_values(chains, logits)) > 1e-6
    c = spec.counters
    assert c.num_drafts == SEQS and c.num_draft_tokens == SEQS * K
    assert c.num_accepted_tokens == sum(len(ch) - 1 for ch in chains) == sum(proposer.told[0][1])
    assert c.accepted_per_position == [sum(len(ch) > j + 1 for ch in chains) for j in range(K)]


def test_the_same_test_fails_a_speculator_that_forgets_the_drafts_before_a_row(seed, monkeypatch):
    monkeypatch.setattr(speculator_module._Position, "output_token_ids",
                        property(lambda self: self.seq.output_token_ids))
    logits, proposer = setting(seed, "one-hot")
    chains, _ = verify_chains(logits, proposer, seed)
    assert min(p_values(chains, logits)) < 1e-6


def test_under_a_grammar_every_position_is_distributed_as_the_masked_target_after_the_drafts_before_it(seed):
    logits, proposer = setting(seed, "one-hot")
    a, b = proposer.chain
    rest = list(range(VOCAB))
    # after 3 and after the first draft, the most likely token but the draft is refused (another after
    # each): the masks bite, and a row masked as the one before it would be is told apart
    ban = {t: random.choice(rest) for t in rest}
    ban[3] = max((t for t in rest if t != a), key=lambda t: float(logits[0, t]))
    ban[a] = max((t for t in rest if t not in (b, ban[3])), key=lambda t: float(target(logits[1], (3, a))[t]))
    chains, spec = verify_chains(logits, proposer, seed, ban)
    assert spec.counters.num_draft_tokens == SEQS * K  # the chain is the grammar's: no draft was cut
    assert min(p_values(chains, logits, ban)) > 1e-6
    assert all(ban[([3] + c)[j]] != c[j] for c in chains for j in range(len(c)))
