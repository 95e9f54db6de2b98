"""benchmarks/e2e_decode.py where no GPU is needed: it imports, and E2E_PRESETS picks or refuses presets."""

from __future__ import annotations

import pytest

from benchmark_script import load


@pytest.fixture(scope="module")
def e2e():
    return load("e2e_decode")


def test_presets_pick_cases_in_their_order(e2e):
    names = [preset for preset, _ in e2e.CASES]
    assert e2e._cases(None) == e2e._cases("") == e2e.CASES
    assert e2e._cases(",".join(reversed(names))) == e2e.CASES
    assert e2e._cases(names[-1]) == (e2e.CASES[-1],)


def test_unknown_preset_is_refused_by_name(e2e):
    with pytest.raises(ValueError, match=r"E2E_PRESETS: unknown \['no-such-model'\]"):
        e2e._cases("qwen3-0.6b,no-such-model")


def test_top_p_differs_from_greedy_only_in_sampling(e2e):
    import dataclasses

    greedy, top_p = dataclasses.asdict(e2e.GREEDY), dataclasses.asdict(e2e.TOP_P)
    assert {k for k in greedy if greedy[k] != top_p[k]} == {"temperature", "top_p", "seed"}
    assert top_p["seed"] is not None and top_p["ignore_eos"]
