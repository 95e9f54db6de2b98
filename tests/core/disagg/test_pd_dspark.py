"""DSpark with the drafter trained for tiny-dsv4-py (tests/assets/tiny-dsv4-py-dspark) on a decode
engine of prefill/decode disaggregation over the tcp transport: the prefill engine sends the
drafter's context rows of the prompt with the KV, so the decode engine proposes every sequence the
drafts a colocated DSpark engine proposes, from its first decode on, n > 1 siblings included; greedy
output equals a colocated engine without speculation; no page of either engine is held afterwards
and no context is kept. Beside it, on the colocated engine: an n > 1 sibling drafts from its
parent's context of the prompt, as the same request with n = 1 does. And a prompt sharing a long
prefix with an earlier one: the prefill engine's hit sends the context rows kept for it, so the
decode engine drafts as an engine that computed the whole prompt, as a colocated engine's hit does."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest

from engine.core.config import EngineConfig
from engine.core.disagg import engine_class
from engine.core.engine import EngineCore
from engine.core.sampling_params import SamplingParams
from engine.core.spec.verify_length import LoadAwareLength, StepCurve

from drafts_spy import Drafts
from test_pd_engines import Pair, assert_idle, colocated
from test_pd_mtp import prompts

ASSET = Path(__file__).resolve().parents[2] / "assets" / "tiny-dsv4-py-dspark"
DSPARK = {"method": "dspark", "num_speculative_tokens": 4, "model": str(ASSET)}


def _engine(model, spec: dict | None, **disagg) -> EngineCore:
    config = EngineConfig(model=str(model), max_model_len=512, num_pages=160, page_size=16, max_num_seqs=16,
                          warmup=False, dtype="float32", speculative_config=spec, disaggregation=disagg or None)
    engine = engine_class(config)(config, progress=False)
    if spec is not None:  # every step memory-bound: every draft verified, whatever this CPU's timings
        engine.speculator.verify_length = LoadAwareLength(StepCurve((1, 64), (1.0, 1.0)), engine.speculator.k)
    return engine


class DSparkPair(Pair):
    def __init__(self, model) -> None:
        self.prefill = _engine(model, DSPARK, mode="prefill", bootstrap_port=0, timeout=5.0)
        self.decode = _engine(model, DSPARK, mode="decode", timeout=5.0)
        self.rooms = iter(range(random.randrange(2**40), 2**62))


@pytest.fixture(scope="module")
def engines(shared_dir):
    """(the pair, a colocated engine without speculation, a colocated engine with DSpark)"""
    model = shared_dir / "models" / "tiny-dsv4-py"
    return DSparkPair(model), _engine(model, None), _engine(model, DSPARK)


def test_the_decode_engine_drafts_as_a_colocated_one_and_answers_as_one_without_drafts(engines, eval_text, seed):
    pair, plain, colocated_dspark = engines
    for e in (pair.prefill, colocated_dspark):  # fresh caches: every prompt computed (hits: the last test)
        e.reset_prefix_cache()
    requests = prompts(plain, eval_text)
    want = colocated(plain, requests)
    with Drafts(colocated_dspark) as here:
        assert colocated(colocated_dspark, requests) == want
    accepted = pair.decode.speculator.counters.num_accepted_tokens
    with Drafts(pair.decode) as there:
        got, failures = pair.run(requests)
    assert not failures and got == want
    assert pair.decode.stats().kv_transfer.num_failed == 0
    assert there.by_seq == here.by_seq
    assert set(there.by_seq) == set(got)  # every sequence drafted, siblings too
    assert pair.decode.speculator.counters.num_accepted_tokens > accepted
    for e in (pair.prefill, pair.decode):
        assert_idle(e)
        assert not e.speculator.proposer._contexts


def test_every_sibling_drafts_as_its_request_alone(engines, eval_text, seed):
    _, plain, colocated_dspark = engines
    colocated_dspark.reset_prefix_cache()
    alone = {rid: (ids, dataclasses.replace(params, n=1)) for rid, (ids, params) in prompts(plain, eval_text).items()}
    with Drafts(colocated_dspark) as one:
        colocated(colocated_dspark, alone)
    colocated_dspark.reset_prefix_cache()
    siblings = {rid + "'": (ids, dataclasses.replace(params, n=3)) for rid, (ids, params) in alone.items()}
    with Drafts(colocated_dspark) as three:
        colocated(colocated_dspark, siblings)
    assert three.by_seq == {(rid + "'", i): one.by_seq[(rid, 0)] for rid in alone for i in range(3)}
    assert_idle(colocated_dspark)
    assert not colocated_dspark.speculator.proposer._contexts


def test_a_prefix_hit_drafts_as_computing_the_prompt(engines, eval_text, seed):
    """A second request sharing a long prefix with the first (past the scheduler's recompute bound,
    so the hit is taken whole): the prefill engine sends the context rows it kept for the hit, and
    the decode engine, like a colocated engine that hit its own cache, drafts as an engine that
    computed the whole prompt."""
    pair, plain, colocated_dspark = engines
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    start = random.randrange(len(eval_text) - 4000)
    text = plain.tokenizer.encode(eval_text[start:start + 4000])
    shared = random.randint(100, 140)  # six pages or more, past the recompute bound of four
    # the shared part first, answered shortly: V4's windows are kept within reach of a cached end only
    first = {"first": (text[:shared], dataclasses.replace(greedy, max_tokens=2))}
    second = {"second": (text[:shared] + text[-random.randint(5, 30):], greedy)}
    want = colocated(plain, second)
    for e in (pair.prefill, pair.decode, colocated_dspark):
        e.reset_prefix_cache()
    with Drafts(colocated_dspark) as computed:
        assert colocated(colocated_dspark, second) == want
    assert computed.by_seq
    got, failures = pair.run(first)
    assert not failures
    hits = pair.prefill.kv_manager.stats().prefix_hits
    with Drafts(pair.decode) as there:
        got, failures = pair.run(second)
    assert not failures and got == want
    assert pair.prefill.kv_manager.stats().prefix_hits - hits >= shared - 16, "the prefill engine hit its cache"
    assert there.by_seq == computed.by_seq
    colocated_dspark.reset_prefix_cache()
    colocated(colocated_dspark, first)
    hits = colocated_dspark.kv_manager.stats().prefix_hits
    with Drafts(colocated_dspark) as hit:
        assert colocated(colocated_dspark, second) == want
    assert colocated_dspark.kv_manager.stats().prefix_hits - hits >= shared - 16
    assert hit.by_seq == computed.by_seq
    for e in (pair.prefill, pair.decode, colocated_dspark):
        assert_idle(e)
        assert not e.speculator.proposer._contexts
