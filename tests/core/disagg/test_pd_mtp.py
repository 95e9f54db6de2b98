"""MTP on a decode engine of prefill/decode disaggregation (tiny-dsv4-py with the next-n layer trained
for it, tests/assets/tiny-dsv4-py-mtp, over the tcp transport): the prefill engine sends the
target's streams of the prompt's last positions with the KV, so the decode engine drafts from its
first decode on, the same drafts a colocated engine with MTP proposes, and keeps some; greedy output
equals a colocated engine without speculation, n > 1 included, prefix hits on both sides included;
no page of either engine's KV caches or of the layer's is held afterwards. A prefill engine started
without MTP is refused as another page layout, and the decode engine computes the prompt itself."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
import torch

from engine.core.config import EngineConfig
from engine.core.disagg import engine_class
from engine.core.engine import EngineCore
from engine.core.sampling_params import SamplingParams

from drafts_spy import Drafts
from test_pd_engines import Pair, assert_idle, colocated

ASSET = Path(__file__).resolve().parents[2] / "assets" / "tiny-dsv4-py-mtp"
MTP = {"method": "mtp", "num_speculative_tokens": 3, "model": str(ASSET)}


def _engine(model, spec: dict | None, **disagg) -> EngineCore:
    config = EngineConfig(model=str(model), max_model_len=512, num_pages=160, page_size=16, warmup=False,
                          dtype="float32", speculative_config=spec, disaggregation=disagg or None)
    return engine_class(config)(config, progress=False)


class MTPPair(Pair):
    def __init__(self, model, prefill_spec: dict | None) -> None:
        self.prefill = _engine(model, prefill_spec, mode="prefill", bootstrap_port=0, timeout=5.0)
        self.decode = _engine(model, MTP, mode="decode", timeout=5.0)
        self.rooms = iter(range(random.randrange(2**40), 2**62))


@pytest.fixture(scope="module")
def model(shared_dir):
    return shared_dir / "models" / "tiny-dsv4-py"


@pytest.fixture(scope="module")
def engines(model):
    """(the pair, a colocated engine without speculation, a colocated engine with MTP)"""
    return MTPPair(model, MTP), _engine(model, None), _engine(model, MTP)


def prompts(engine: EngineCore, text: str) -> dict:
    """Passages of python-eval.txt, the layer's window short of, past and aligned with their ends."""
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    lengths = [random.randint(5, 40), random.randint(66, 100), 16 * random.randint(5, 6) + 1, random.randint(66, 100)]
    requests = {}
    for i, n in enumerate(lengths):
        start = random.randrange(len(text) - 8 * n)
        requests[f"r{i}"] = (engine.tokenizer.encode(text[start:start + 8 * n])[:n],
                             dataclasses.replace(greedy, n=2) if i == 3 else greedy)
    return requests


def assert_layer_idle(engine: EngineCore) -> None:
    proposer = engine.speculator.proposer
    proposer.kv.check_consistency()
    assert not proposer._seqs and not proposer._features and proposer.kv.stats().usage == 0.0


def test_the_decode_engine_drafts_as_a_colocated_one_and_answers_as_one_without_drafts(engines, eval_text, seed):
    pair, plain, colocated_mtp = engines
    requests = prompts(plain, eval_text)
    want = colocated(plain, requests)
    with Drafts(colocated_mtp) as here:
        assert colocated(colocated_mtp, requests) == want
    for again in ("", "'"):  # the second time the prefill engine's prefix cache and the layer's hit
        accepted = pair.decode.speculator.counters.num_accepted_tokens
        with Drafts(pair.decode) as there:
            got, failures = pair.run({rid + again: r for rid, r in requests.items()})
        assert not failures and got == {(rid + again, i): tokens for (rid, i), tokens in want.items()}
        assert pair.decode.stats().kv_transfer.num_failed == 0
        assert there.by_seq == {(rid + again, i): d for (rid, i), d in here.by_seq.items()}
        assert set(there.by_seq) == set(got)  # every sequence drafted, siblings too
        assert pair.decode.speculator.counters.num_accepted_tokens > accepted
        for e in (pair.prefill, pair.decode):
            assert_idle(e)
        assert_layer_idle(pair.decode)
        assert not pair.prefill.speculator.proposer._features


def test_a_prefill_engine_without_mtp_is_refused_and_the_prompt_computed_on_the_decode_engine(engines, model,
                                                                                                eval_text, seed):
    _, plain, _ = engines
    pair = MTPPair(model, None)
    requests = dict(list(prompts(plain, eval_text).items())[1:2])
    got, failures = pair.run(requests)
    assert not failures and got == colocated(plain, requests)
    assert pair.decode.stats().kv_transfer.num_failed == 1 and pair.decode.speculator.counters.num_drafts > 0
    for e in (pair.prefill, pair.decode):
        assert_idle(e)
    assert_layer_idle(pair.decode)


def test_a_sequence_let_go_before_its_first_catch_up_caches_nothing_it_did_not_write(engines):
    """Its windows hold the unwritten positions before the carried ones: a hit there would read them."""
    pair, _, _ = engines
    proposer = pair.decode.speculator.proposer
    prompt = [random.randrange(5, 4000) for _ in range(random.randint(100, 200))]
    start = len(prompt) - 1 - proposer.carried
    proposer.carry_in(-1, prompt, start, torch.randn(proposer.carried, proposer.carried_row))
    assert proposer.kv.state(proposer._seqs[-1]).num_tokens == start
    proposer.release(-1)
    keys = [a * 4096 + b for a, b in zip(prompt, prompt[1:])]
    assert proposer.kv.radix.match(keys, record=False).num_tokens == 0
    assert_layer_idle(pair.decode)
