"""The load-aware verify length on given throughput curves: a memory-bound step verifies every
draft worth anything, a compute-bound one none; confident requests get longer runs than doubtful
ones; as the batch grows toward the compute-bound part of the curve the lengths shrink to 0, and a
step that cannot gain does not draft at all."""

from __future__ import annotations

import pytest

from engine.core.spec.verify_length import LoadAwareLength, StepCurve, choose_lengths

# a GPU-like step: flat (memory-bound) up to 64 tokens, then proportional to its tokens
KNEE = StepCurve((1, 64, 128, 256), (0.010, 0.010, 0.020, 0.040))


def rate(confidence, lengths, curve, overhead=0.0):
    """Expected tokens per second of the choice ``lengths``."""
    tokens = len(confidence)
    for conf, n in zip(confidence, lengths):
        p = 1.0
        for c in conf[:n]:
            p *= c
            tokens += p
    return tokens / (curve(len(confidence) + sum(lengths)) + overhead)


def test_the_curve_interpolates_extends_and_never_falls():
    c = StepCurve((1, 4, 16), (0.010, 0.004, 0.016))  # a noisy dip is levelled
    assert c.seconds == (0.010, 0.010, 0.016)
    assert c(1) == 0.010 and c(10) == pytest.approx(0.013) and c(28) == pytest.approx(0.022)
    with pytest.raises(ValueError, match="two or more increasing"):
        StepCurve((4,), (0.1,))


def test_a_memory_bound_step_verifies_every_draft_a_compute_bound_one_none():
    conf = [[0.9, 0.8, 0.7, 0.6, 0.5], [0.5, 0.5, 0.5, 0.5, 0.5]]
    assert choose_lengths(conf, KNEE) == [5, 5]
    compute = StepCurve((1, 256), (0.001, 0.256))  # every token costs what a request's own token costs
    assert choose_lengths(conf, compute) == [0, 0]
    assert choose_lengths([[1.0, 1.0]], compute) == [0]  # a sure draft gains nothing either


def test_confident_requests_get_longer_runs_and_the_choice_is_the_best():
    curve = StepCurve((1, 2, 16), (0.010, 0.011, 0.025))
    conf = [[0.95, 0.9, 0.9, 0.85, 0.8], [0.3, 0.2, 0.1, 0.1, 0.1], [0.7, 0.6, 0.5, 0.4, 0.3]]
    lengths = choose_lengths(conf, curve)
    assert lengths[0] > lengths[2] > lengths[1] >= 0
    best = rate(conf, lengths, curve)
    for a in range(6):  # against every other choice
        for b in range(6):
            for c in range(6):
                assert rate(conf, [a, b, c], curve) <= best + 1e-12


@pytest.mark.parametrize("overhead", [0.0, 0.005])
def test_lengths_shrink_to_0_as_the_batch_grows(overhead):
    conf = [0.8, 0.7, 0.6, 0.5, 0.4]
    totals = [sum(choose_lengths([conf] * b, KNEE, overhead)) / b for b in (1, 8, 32, 64, 128, 256)]
    assert totals[0] == 5 and totals[-1] == 0
    assert all(a >= b for a, b in zip(totals, totals[1:]))
    for b in (1, 32, 128):  # never slower than no speculation
        lengths = choose_lengths([conf] * b, KNEE, overhead)
        assert rate([conf] * b, lengths, KNEE, overhead) >= rate([conf] * b, [0] * b, KNEE, overhead)


def test_a_step_that_cannot_gain_does_not_draft():
    load = LoadAwareLength(KNEE, 5)
    assert load.worth_drafting(1) and load.worth_drafting(32)  # optimistic before any draft
    load.drafted(1, 0.001, [[0.3, 0.1, 0.05, 0.0, 0.0]])
    for _ in range(40):
        load.drafted(200, 0.004, [[0.3, 0.1, 0.05, 0.0, 0.0]] * 200)
    assert load.typical[0] == pytest.approx(0.3, abs=0.02)
    assert load.worth_drafting(1)  # cheap drafts still pay at batch 1
    assert not load.worth_drafting(200)  # compute-bound: the drafter's own time is lost
    assert not load.worth_drafting(1, others=255)
