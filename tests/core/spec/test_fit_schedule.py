"""The drafters' training loop (core/spec/train_drafter.fit): its one-cycle learning rate ends
annealed whether the step count or the clock runs out first."""

from __future__ import annotations

import time

import pytest
import torch

from engine.core.spec.train_drafter import END, START, fit, one_cycle


def test_one_cycle_climbs_to_the_peak_then_anneals():
    assert one_cycle(0.0) == pytest.approx(START) and one_cycle(0.1) == pytest.approx(1.0)
    assert one_cycle(1.0) == pytest.approx(END) and one_cycle(0.55) == pytest.approx((1 + END) / 2)
    rising, falling = [one_cycle(p / 100) for p in range(11)], [one_cycle(p / 100) for p in range(10, 101)]
    assert rising == sorted(rising) and falling == sorted(falling, reverse=True)


def _moves(steps: int, seconds: float | None, pause: float) -> list[float]:
    """How far AdamW moved a parameter at each step (about the learning rate, Adam's steps being
    normalised): the loss's gradient keeps one sign, so every step moves it the same way."""
    w = torch.zeros(1)
    seen: list[float] = []

    def loss_of() -> torch.Tensor:
        seen.append(w.item())
        time.sleep(pause)
        return w.sum() * 3.0

    fit([w], loss_of, steps, 0.1, "schedule", False, seconds)
    seen.append(w.item())
    return [abs(b - a) for a, b in zip(seen, seen[1:])]


@pytest.mark.parametrize("seconds", [None, 0.4])
def test_the_last_steps_move_little_whichever_budget_ends_the_run(seconds):
    moves = _moves(40 if seconds is None else 100_000, seconds, 0.0 if seconds is None else 0.01)
    assert 10 <= len(moves) < 100_000  # the clock ended the second run long before its steps
    peak = max(moves)
    assert peak > 0.05 and moves[-1] < 0.05 * peak and moves[0] < 0.1 * peak
