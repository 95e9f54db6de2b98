"""On a GPU, the start-up warm-up compiles every Triton kernel a random workload then meets."""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams

pytestmark = pytest.mark.gpu


def _workload(seed: int, vocab: int, max_len: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts of random lengths (a page-aligned one sent twice) under every sampling option."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(1, max_len))] for _ in range(24)]
    prompts.append(prompts[0][:32] + [rng.randrange(vocab)])
    options = [dict(temperature=0.0), dict(temperature=0.7, top_p=0.8), dict(temperature=1.0, top_k=5, min_p=0.1),
               dict(temperature=0.9, repetition_penalty=1.2, frequency_penalty=0.3, seed=rng.randrange(99)),
               dict(temperature=0.0, logprobs=3), dict(temperature=0.0, prompt_logprobs=1)]
    params = [SamplingParams(max_tokens=rng.randint(1, 20), ignore_eos=True, **rng.choice(options)) for _ in prompts]
    return prompts, params


def _probe_kernel():
    """A kernel to compile inside the watched region (a new N each time): proof that the hook fires.
    Decorated here, not at collection, which may come before the interpreter's switch is set."""
    import triton
    import triton.language as tl

    @triton.jit
    def _probe_kernel(x_ptr, N: tl.constexpr):
        tl.store(x_ptr + tl.arange(0, 16), tl.full((16,), N, tl.float32))

    return _probe_kernel


@pytest.mark.parametrize("model", ["tiny-qwen3-py", "tiny-dsv4-py"])
def test_a_served_workload_compiles_nothing_after_the_warm_up(shared_dir, seed, model):
    llm = LLM(str(shared_dir / "models" / model), device="cuda", dtype="bfloat16", max_model_len=1024,
              max_num_seqs=32, progress=False)
    assert llm.engine.warmup is not None and llm.engine.warmup.cached_tokens > 0
    import triton

    probe = _probe_kernel()
    compiled: list[str] = []

    def hook(*, repr: str, **_) -> None:  # the kernel's name, launch options and argument types
        compiled.append(repr)

    runtime = triton.knobs.runtime
    saved, runtime.jit_post_compile_hook = runtime.jit_post_compile_hook, hook
    try:
        prompts, params = _workload(seed, llm.engine.vocab_size, 600)
        outs = llm.generate(prompts, params)
        probe[(1,)](torch.empty(16, device="cuda"), N=random.randrange(1 << 30))
    finally:
        runtime.jit_post_compile_hook = saved
    assert all(o.finished for o in outs)
    assert compiled and "_probe_kernel" in compiled[-1], compiled
    assert not compiled[:-1], "compiled after the warm-up:\n" + "\n".join(sorted(set(compiled[:-1])))
