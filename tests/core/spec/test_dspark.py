"""The DSpark proposer end to end with a freshly initialised drafter for each tiny model (its drafts
are poor; verification keeps the output the target's): greedy output identical to decoding
without speculation over chunked prefill, prefix hits, n=2, preemption and aborts; nothing held
for sequences gone; the verify step timed at start-up, and under a compute-bound curve nothing
verified; a drafter for another model, of another method, with too small a block or none at all
refused at start-up naming the field.

The equality tests give the engine a memory-bound curve (every step 1 s whatever its tokens), so
that every draft is verified whatever the CPU's own timings say."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch

from engine import LLM
from engine.core.spec.config import SpecConfigError
from engine.core.spec.dspark.weights import build_drafter, save_dspark, shape_for
from engine.core.spec.verify_length import LoadAwareLength, StepCurve
from test_spec_decode import PAGE, assert_clean, completions, greedy, repetitive, run_with_aborts, text_ids

MODELS = ["tiny-dsv4-py", "tiny-qwen3-py"]


def make(path, drafter=None, curve=StepCurve((1, 64), (1.0, 1.0)), **kw) -> LLM:
    opts = dict(dtype="float32", page_size=PAGE, num_pages=400, chunked_prefill_size=16, max_num_seqs=8,
                progress=False)
    if drafter is not None:
        opts["speculative_config"] = {"method": "dspark", "num_speculative_tokens": 4, "model": str(drafter)}
    llm = LLM(str(path), **{**opts, **kw})
    if drafter is not None:
        llm.engine.speculator.verify_length = LoadAwareLength(curve, 4)
    return llm


def write_drafter(llm: LLM, target_dir, out, seed: int):
    """A freshly initialised drafter for the model ``llm`` serves, as a drafter directory."""
    torch.manual_seed(seed)
    target = llm.engine.components.model
    save_dspark(out, target_dir, build_drafter(target, shape_for(target)), {})
    return out


@pytest.fixture(scope="module", params=MODELS)
def setup(request, shared_dir, tmp_path_factory, run_seed):
    """(the target's directory, decoding without speculation, with DSpark, the drafter's directory)"""
    path = shared_dir / "models" / request.param
    plain = make(path, enable_prefix_caching=False)
    drafter = write_drafter(plain, path, tmp_path_factory.mktemp("dspark") / request.param, run_seed)
    return path, plain, make(path, drafter), drafter


def drafted(llm: LLM) -> int:
    return llm.engine.speculator.counters.num_draft_tokens


def test_greedy_equals_decoding_without_drafts_over_chunks_prefix_hits_and_n2(setup, eval_text, seed):
    _, plain, spec, _ = setup
    prompts = [repetitive(plain, eval_text), text_ids(plain, eval_text, 30)]
    params = [greedy(random.randint(10, 16), n=n) for n in (1, 2)]
    want = plain.generate(prompts, params)
    before = drafted(spec)
    assert completions(spec.generate(prompts, params)) == completions(want)
    assert drafted(spec) > before
    before = drafted(spec)
    again = spec.generate(prompts, params)  # every prompt hits the prefix cache: drafted from the hit's end on
    assert all(o.num_cached_tokens > 0 for o in again) and drafted(spec) > before
    assert completions(again) == completions(want)
    assert_clean(spec, [o.prompt_token_ids + c.token_ids for o in want for c in o.outputs])
    assert not spec.engine.speculator.proposer._contexts  # nothing held for sequences gone


def test_greedy_equals_decoding_without_drafts_under_preemption_and_aborts(setup, eval_text, seed):
    path, plain, _, drafter = setup
    spec = make(path, drafter, num_pages=24, max_num_batched_tokens=64)
    prompts = [text_ids(plain, eval_text, 24) for _ in range(3)]
    params = greedy(14)
    want = plain.generate(prompts, params)
    assert completions(spec.generate(prompts, params)) == completions(want)
    assert spec.engine.stats().num_preemptions > 0 and drafted(spec) > 0
    abort_after = {i: random.randint(2, 10) for i in random.sample(range(3), 2)}
    ended = run_with_aborts(spec, prompts, params, abort_after)
    for i in range(3):
        tokens, reason = ended[f"r{i}"][0][:2]
        assert tokens == want[i].outputs[0].token_ids[:len(tokens)]
        assert reason == ("abort" if i in abort_after else "length")
    assert not spec.engine.speculator.proposer._contexts
    spec.engine.kv_manager.reset_prefix_cache()
    assert_clean(spec, [])


def test_the_verify_step_is_timed_at_start_up_and_a_compute_bound_one_verifies_no_draft(setup, eval_text, seed):
    path, plain, _, drafter = setup
    spec = LLM(str(path), dtype="float32", page_size=PAGE, num_pages=64, max_num_seqs=4, progress=False,
               speculative_config={"method": "dspark", "num_speculative_tokens": 4, "model": str(drafter)})
    curve = spec.engine.speculator.verify_length.curve
    assert curve.tokens == (1, 4, 5, 20) and all(s > 0 for s in curve.seconds)
    assert spec.engine.kv_manager.stats().num_free == spec.engine.kv_manager.stats().num_usable
    spec.engine.speculator.verify_length = LoadAwareLength(StepCurve((1, 64), (0.001, 0.064)), 4)
    prompts = [text_ids(plain, eval_text, 20) for _ in range(2)]
    assert completions(spec.generate(prompts, greedy(8))) == completions(plain.generate(prompts, greedy(8)))
    assert drafted(spec) == 0


def test_a_drafter_that_cannot_draft_here_is_refused_at_start_up_naming_the_field(setup, shared_dir, tmp_path):
    path, _, _, drafter = setup
    other = shared_dir / "models" / next(m for m in MODELS if m != path.name)
    cases = [(other, {}, f"speculative_config.model: {drafter} is a drafter for another model ({path.name})"),
             (path, {"num_speculative_tokens": 6}, "speculative_config.num_speculative_tokens: 6 is more than the "
                                                   "drafter's block of 5"),
             (path, {"model": None}, "speculative_config.model: DSpark needs a drafter directory")]
    bad = tmp_path / "mtp"
    shutil.copytree(drafter, bad)
    meta = json.loads((bad / "drafter.json").read_text())
    (bad / "drafter.json").write_text(json.dumps({**meta, "method": "mtp"}))
    cases.append((path, {"model": str(bad)}, "is a 'mtp' drafter, not 'dspark'"))
    for target, extra, reason in cases:
        spec = {"method": "dspark", "num_speculative_tokens": 4, "model": str(drafter), **extra}
        with pytest.raises(SpecConfigError, match="speculative_config.method: 'dspark' cannot run here") as err:
            LLM(str(target), speculative_config={k: v for k, v in spec.items() if v is not None}, progress=False,
                num_pages=64)
        assert reason in str(err.value)


@pytest.mark.gpu
def test_on_cuda_greedy_equals_decoding_without_drafts_over_chunks_and_prefix_hits(setup, eval_text, seed):
    """fp32 on the CUDA backends, graphs captured (steps that hand back features replay prefill graphs):
    every draft verified, then the verify length the start-up curve of the GPU chooses."""
    path, plain, _, drafter = setup
    cuda = make(path, drafter, device="cuda")
    prompts = [repetitive(plain, eval_text), text_ids(plain, eval_text, 30), text_ids(plain, eval_text, 20)]
    params = [greedy(16, n=n) for n in (1, 2, 1)]
    want = completions(plain.generate(prompts, params))
    assert completions(cuda.generate(prompts, params)) == want and drafted(cuda) > 0
    again = cuda.generate(prompts, params)
    assert all(o.num_cached_tokens > 0 for o in again) and completions(again) == want
    by_load = LLM(str(path), dtype="float32", page_size=PAGE, num_pages=400, device="cuda", progress=False,
                  speculative_config={"method": "dspark", "num_speculative_tokens": 4, "model": str(drafter)})
    assert len(by_load.engine.speculator.verify_length.curve.tokens) >= 4
    assert completions(by_load.generate(prompts, params)) == want
