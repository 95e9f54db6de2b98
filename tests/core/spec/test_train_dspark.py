"""``engine train-drafter --method dspark``: it writes a drafter directory the DSpark proposer loads,
and the drafter trained for tiny-dsv4-py kept in tests/assets keeps drafts on held-out text while
the output stays the target's; its loss reads each block's features before its anchor only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine import LLM
from engine.core.spec.dspark.train import anchored_mask
from engine.core.spec.verify_length import LoadAwareLength, StepCurve
from test_spec_decode import completions, greedy, text_ids
from test_train_drafter import train_drafter

ASSET = Path(__file__).resolve().parents[2] / "assets" / "tiny-dsv4-py-dspark"


def dspark(target, drafter, **kw) -> LLM:
    llm = LLM(str(target), dtype="float32", page_size=4, num_pages=400, chunked_prefill_size=16, progress=False,
              speculative_config={"method": "dspark", "num_speculative_tokens": 5, "model": str(drafter)}, **kw)
    llm.engine.speculator.verify_length = LoadAwareLength(StepCurve((1, 64), (1.0, 1.0)), 5)  # every draft verified
    return llm


@pytest.fixture(scope="module")
def target(shared_dir):
    return shared_dir / "models" / "tiny-dsv4-py"


@pytest.fixture(scope="module")
def plain(target):
    return LLM(str(target), dtype="float32", page_size=4, num_pages=400, chunked_prefill_size=16, progress=False,
               enable_prefix_caching=False)


def test_blocks_in_training_see_the_context_before_their_anchor_and_their_own_block():
    mask = anchored_mask(torch.tensor([[2, 5]]), 6, 3)
    assert mask.shape == (1, 6, 12)
    want_ctx = [[1, 1, 0, 0, 0, 0]] * 3 + [[1, 1, 1, 1, 1, 0]] * 3
    want_own = [[1, 1, 1, 0, 0, 0]] * 3 + [[0, 0, 0, 1, 1, 1]] * 3
    assert mask[0, :, :6].int().tolist() == want_ctx and mask[0, :, 6:].int().tolist() == want_own


def test_train_drafter_writes_a_drafter_the_dspark_proposer_loads(target, plain, tmp_path, eval_text, seed):
    out = tmp_path / "drafter"
    res = train_drafter(target, "dspark", out, seed, "--steps", "3", "--max-minutes", "0")
    # --max-minutes 0: the time is spent after the first of the three steps
    assert "trained 1 steps on 64 tokens" in res.stdout and "stopped after 1 of 3 steps" in res.stderr
    meta = json.loads((out / "drafter.json").read_text())
    assert meta["method"] == "dspark" and meta["target_name"] == "tiny-dsv4-py" and meta["shape"]["block_size"] == 5
    prompts = [text_ids(plain, eval_text, 24) for _ in range(2)]
    spec = dspark(target, out)
    assert completions(spec.generate(prompts, greedy(12))) == completions(plain.generate(prompts, greedy(12)))
    assert spec.engine.speculator.counters.num_draft_tokens > 0


def test_the_trained_drafter_keeps_drafts_and_the_targets_output(target, plain, eval_text, seed):
    spec = dspark(target, ASSET)
    prompts = [text_ids(plain, eval_text, 48) for _ in range(4)]
    params = greedy(24)
    assert completions(spec.generate(prompts, params)) == completions(plain.generate(prompts, params))
    c = spec.engine.speculator.counters
    assert c.num_drafts > 10 and c.mean_acceptance_length > 1.25, c


@pytest.mark.gpu
def test_on_cuda_the_trained_drafter_keeps_drafts_and_the_targets_output(target, eval_text, seed):
    """fp32 on the CUDA backends (steps that hand back the features replay prefill graphs), the verify length
    chosen by the curve timed at start-up on the GPU."""
    plain = LLM(str(target), dtype="float32", page_size=4, num_pages=400, device="cuda", progress=False,
                enable_prefix_caching=False)
    spec = LLM(str(target), dtype="float32", page_size=4, num_pages=400, device="cuda", progress=False,
               speculative_config={"method": "dspark", "num_speculative_tokens": 5, "model": str(ASSET)})
    prompts = [text_ids(plain, eval_text, 48) for _ in range(6)]
    params = greedy(32)
    assert completions(spec.generate(prompts, params)) == completions(plain.generate(prompts, params))
    assert spec.engine.speculator.counters.num_draft_tokens > 0
