"""``EngineConfig.seed`` (``--seed``) seeds the draws of requests that bring no seed of their own."""

from __future__ import annotations

import random

from engine import LLM, SamplingParams


def test_the_engine_seed_repeats_unseeded_sampling(tiny_qwen3):
    seed = random.randrange(2**31)
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, n=2)

    def run(engine_seed: int) -> list[list[int]]:
        llm = LLM(str(tiny_qwen3), progress=False, seed=engine_seed, num_pages=16, max_num_seqs=4)
        try:
            return [c.token_ids for out in llm.generate(["hello", "def f"], params) for c in out.outputs]
        finally:
            llm.engine.shutdown()

    first = run(seed)
    assert run(seed) == first
    assert run(seed + 1) != first
