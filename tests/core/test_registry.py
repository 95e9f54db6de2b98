"""The selection rule every family shares: best usable priority, ties by name, loud explicit requests."""

from __future__ import annotations

import random

import pytest

from engine.core.plugins import CPU_PLATFORM
from engine.core.platform import PlatformSpec
from engine.core.registry import Descriptor, SelectionContext, SelectionError, describe_candidates, select

CTX = SelectionContext(platform=CPU_PLATFORM)


def _desc(name: str, priority=0, reasons: list[str] | None = None, plugin: str = "test") -> Descriptor:
    return Descriptor("attention", name, lambda ctx: name, priority=priority,
                      check=lambda ctx: list(reasons or []), plugin=plugin)


def test_highest_usable_priority_wins_and_candidates_are_ordered(seed):
    rng = random.Random(seed)
    descs = [_desc(f"b{i}", rng.randrange(-50, 50), ["cannot"] if rng.random() < 0.4 else None) for i in range(12)]
    descs.append(_desc("always-ok", -100))  # so at least one can serve
    rng.shuffle(descs)

    sel = select("attention", descs, CTX)

    usable = [d for d in descs if not d.check(CTX)]
    best = min(usable, key=lambda d: (-d.priority, d.name))
    assert sel.chosen is best and not sel.explicit
    assert [c.descriptor for c in sel.candidates] == sorted(descs, key=lambda d: (-d.priority, d.name))
    assert [c.priority for c in sel.candidates] == sorted((d.priority for d in descs), reverse=True)
    assert all(c.reasons == tuple(c.descriptor.check(CTX)) for c in sel.candidates)
    assert sel.create(CTX) == best.name


def test_ties_are_broken_by_name(seed):
    names = [f"backend-{c}" for c in "qwertyuiop"]
    random.Random(seed).shuffle(names)
    sel = select("attention", [_desc(n, 7) for n in names], CTX)
    assert sel.chosen.name == "backend-e"
    assert [c.descriptor.name for c in sel.candidates] == sorted(names)


def test_priority_may_depend_on_the_platform():
    hopper = PlatformSpec("nvidia", "sm_90", "H200", "cuda")
    arch_aware = Descriptor("attention", "arch-aware", lambda ctx: None,
                            priority=lambda ctx: 100 if ctx.platform.arch == "sm_90" else -1)
    flat = _desc("flat", 10)
    assert select("attention", [arch_aware, flat], SelectionContext(hopper)).chosen is arch_aware
    assert select("attention", [arch_aware, flat], CTX).chosen is flat


def test_a_check_that_raises_becomes_a_reason():
    def broken(ctx):
        raise KeyError("no such field")

    bad = Descriptor("attention", "bad", lambda ctx: None, priority=99, check=broken, plugin="p")
    sel = select("attention", [bad, _desc("good", 1)], CTX)
    assert sel.chosen.name == "good"
    (cand,) = [c for c in sel.candidates if c.descriptor is bad]
    assert cand.reasons == ("check raised KeyError: 'no such field'",)
    with pytest.raises(SelectionError, match="check raised KeyError"):
        select("attention", [bad], CTX)


def test_explicit_request_overrides_priority():
    sel = select("attention", [_desc("fast", 100), _desc("slow", 1)], CTX, requested="slow")
    assert sel.chosen.name == "slow" and sel.explicit


def test_explicit_request_that_refuses_names_every_candidate_and_reason():
    descs = [_desc("picky", 5, ["needs sm_90", "needs fp8"], plugin="vendor"), _desc("ok", 1),
             _desc("other", 3, ["wrong dtype"])]
    with pytest.raises(SelectionError) as err:
        select("attention", descs, CTX, requested="picky")
    msg = str(err.value)
    assert "'picky' cannot run here: needs sm_90; needs fp8" in msg
    for line in ("picky (plugin vendor, priority 5): needs sm_90; needs fp8", "ok (plugin test, priority 1): ok",
                 "other (plugin test, priority 3): wrong dtype"):
        assert line in msg
    assert {c.descriptor.name for c in err.value.candidates} == {"picky", "ok", "other"}


def test_unknown_request_lists_candidates():
    with pytest.raises(SelectionError) as err:
        select("attention", [_desc("a", 1), _desc("b", 2, ["no"])], CTX, requested="c")
    msg = str(err.value)
    assert "'c' is not registered" in msg and "a (plugin test, priority 1): ok" in msg and "b (plugin test" in msg


def test_a_name_registered_twice_is_refused_when_requested():
    descs = [_desc("same", 1, plugin="one"), _desc("same", 2, plugin="two")]
    with pytest.raises(SelectionError, match=r"registered by several plugins \(two, one\)"):
        select("attention", descs, CTX, requested="same")


def test_a_name_registered_twice_means_the_one_that_can_run_here():
    descs = [_desc("same", 1, ["needs an AMD GPU"], plugin="rocm"), _desc("same", 2, plugin="cuda")]
    sel = select("attention", descs, CTX, requested="same")
    assert sel.chosen.plugin == "cuda" and sel.explicit
    with pytest.raises(SelectionError, match="registered by several plugins"):  # neither can: ambiguous
        select("attention", [_desc("same", 1, ["no"], plugin="a"), _desc("same", 2, ["no"], plugin="b")], CTX,
               requested="same")


def test_nothing_usable_or_nothing_registered_is_an_error():
    with pytest.raises(SelectionError, match="no attention backend can run here") as err:
        select("attention", [_desc("x", 1, ["broken"])], CTX)
    assert "x (plugin test, priority 1): broken" in str(err.value)
    with pytest.raises(SelectionError, match=r"\(no candidates registered\)"):
        select("attention", [], CTX)
    assert describe_candidates([]) == "  (no candidates registered)"
