"""The asyncio front: streaming, concurrent requests, early exit aborts and frees pages."""

from __future__ import annotations

import asyncio
import random

import pytest

from engine import LLM, SamplingParams
from engine.core.async_engine import AsyncLLM
from engine.core.config import EngineConfig
from engine.core.engine import EngineCore

OPTS = dict(dtype="float32", page_size=4, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def async_llm(tiny_qwen3):
    front = AsyncLLM(EngineCore(EngineConfig(model=str(tiny_qwen3), **OPTS), progress=False))
    yield front.core, front
    front.shutdown()


def collect(front, prompt, params, rid):
    async def run():
        return [out async for out in front.generate(prompt, params, rid)]
    return asyncio.run(run())


def test_stream_is_cumulative_and_ends_like_generate(async_llm):
    _, front = async_llm
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = collect(front, "import os\n", params, "s1")
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    assert lengths == sorted(lengths) and lengths[-1] == 12 and len(outs) >= 2
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
    for a, b in zip(outs, outs[1:]):
        assert b.outputs[0].text.startswith(a.outputs[0].text)


def test_concurrent_streams_and_early_exit_free_pages(async_llm):
    core, front = async_llm
    kv = core.kv_manager
    free_before = kv.stats().num_free

    async def run():
        params = SamplingParams(temperature=0.7, seed=3, max_tokens=40, ignore_eos=True)

        async def full(i):
            return [o async for o in front.generate(f"def f{i}(x):", params, f"c{i}")][-1]

        async def leave_early(i):
            async for o in front.generate(f"class C{i}:", params, f"e{i}"):
                if len(o.outputs[0].token_ids) >= 3:
                    break

        results = await asyncio.gather(*(full(i) for i in range(4)), *(leave_early(i) for i in range(4)))
        for _ in range(100):
            if not core.has_unfinished_requests():
                break
            await asyncio.sleep(0.05)
        return results[:4]

    finals = asyncio.run(run())
    assert all(len(o.outputs[0].token_ids) == 40 for o in finals)
    assert not core.has_unfinished_requests()
    assert kv.stats().num_free == free_before
    kv.check_consistency()


def test_validation_error_raises_and_engine_keeps_serving(async_llm):
    _, front = async_llm
    with pytest.raises(ValueError, match="max_tokens"):
        collect(front, "x", SamplingParams(max_tokens=10**9), "bad")
    assert collect(front, "x", SamplingParams(max_tokens=2, ignore_eos=True), "good")[-1].finished


def test_stop_strings_end_it_as_in_llm_generate(async_llm, tiny_qwen3, seed):
    """Both read the core through the same RequestState: equal tokens, text and endings."""
    _, front = async_llm
    llm = LLM(str(tiny_qwen3), progress=False, **OPTS)
    params = SamplingParams(n=2, temperature=0.8, seed=seed, max_tokens=random.randint(4, 24), ignore_eos=True,
                            stop=random.sample(["e", " ", "(", "in", "\n"], 2), min_tokens=random.randint(0, 3))
    prompt = random.choice(["def main(", "import os\n", "class Tree:"])
    want = llm.generate(prompt, params)[0]
    got = collect(front, prompt, params, f"stop-{seed}")[-1]
    assert got.finished and got.outputs == want.outputs and got.prompt_token_ids == want.prompt_token_ids
