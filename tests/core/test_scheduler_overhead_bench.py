"""benchmarks/scheduler_overhead.py's bytecode count: opcodes per step, the tracer put back."""

from __future__ import annotations

import sys

from benchmark_script import load


class Summing:
    """A step of known, fixed Python work."""

    def __init__(self, n: int) -> None:
        self.n = n

    def step(self) -> int:
        total = 0
        for i in range(self.n):
            total += i
        return total


def test_bytecodes_are_counted_per_step_and_the_tracer_put_back():
    bench = load("scheduler_overhead")
    before = sys.gettrace()
    one, three = bench.count_bytecodes(Summing(10), 1), bench.count_bytecodes(Summing(10), 3)
    assert three == 3 * one
    assert bench.count_bytecodes(Summing(20), 1) - one == 10 * (bench.count_bytecodes(Summing(11), 1) - one)  # per iteration
    assert sys.gettrace() is before
