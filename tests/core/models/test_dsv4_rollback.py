"""Rolling back DeepSeek-V4 tokens restores every component: after decoding tokens one step at a
time, rolling some back and decoding another continuation, the logits equal, bit for bit in fp32,
those of a cache that never saw the rolled-back tokens, where the rolled-back tokens closed CSA
(rate 4) and HCA (rate 16) windows and the new end lies inside both kinds of window."""

from __future__ import annotations

import random

import pytest
import torch

from engine.core.config import EngineConfig
from engine.core.forward import ForwardBatch
from engine.core.kv.manager import KVManager
from engine.core.kv.storage import KVCache
from engine.core.sampling_params import SamplingParams
from engine.core.sequence import Sequence
from engine.core.startup import build

PAGE, PAGES, WINDOW_PAGES = 4, 64, 40
PROMPT, DECODED, ROLLED_BACK, CONTINUATION = 75, 12, 10, 8  # decodes 75..86, returns to 77


@pytest.fixture(scope="module")
def model(shared_dir):
    return build(EngineConfig(model=str(shared_dir / "models" / "tiny-dsv4-py"), dtype="float32", device="cpu",
                              page_size=PAGE, num_pages=PAGES, window_pages=WINDOW_PAGES), progress=False).model


class Cache:
    """A KV cache of its own and the manager that owns it, for one sequence stepped by hand."""

    def __init__(self, model, prompt: list[int], max_rollback: int = 0) -> None:
        self.model = model
        self.kv = KVCache(model.kv_layer_specs(), PAGES, PAGE, torch.float32, "cpu", WINDOW_PAGES)
        self.m = KVManager(PAGES, PAGE, False, self.kv, WINDOW_PAGES, model.window_reach(), max_rollback)
        self.seq = Sequence(0, "r", 0, list(prompt), SamplingParams())

    def step(self, tokens: list[int]) -> torch.Tensor:
        """The logits of every token of one step over ``tokens`` after the committed ones."""
        done = self.m.state(self.seq).num_tokens if self.m.state(self.seq) else 0
        if done >= len(self.seq.prompt_token_ids):
            self.seq.output_token_ids.extend(tokens)
        assert self.m.allocate(self.seq, len(tokens))
        batch = ForwardBatch.build(tokens, [len(tokens)], [done], [self.m.pages(self.seq)], PAGE,
                                   list(range(len(tokens))))
        with torch.inference_mode():
            batch.attn_metadata = self.model.prepare(batch)
            logits = self.model.compute_logits(self.model(batch, self.kv)[batch.logits_indices])
        self.m.commit(self.seq, done + len(tokens))
        return logits

    def decode(self, tokens: list[int]) -> list[torch.Tensor]:
        return [self.step([t]) for t in tokens]

    def rollback(self, num_tokens: int) -> None:
        self.m.rollback(self.seq, num_tokens)
        del self.seq.output_token_ids[num_tokens - len(self.seq.prompt_token_ids):]


def test_rollback_decodes_as_if_the_tokens_were_never_computed(model, seed):
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    prompt = [rng.randrange(vocab) for _ in range(PROMPT)]
    decoded = [rng.randrange(vocab) for _ in range(DECODED)]
    continuation = [rng.randrange(vocab) for _ in range(CONTINUATION)]
    end = PROMPT + DECODED - ROLLED_BACK
    rolled_back = range(end, PROMPT + DECODED)
    assert end % 4 and end % 16  # the new end is inside a CSA and an HCA window
    assert any(p % 4 == 3 for p in rolled_back) and any(p % 16 == 15 for p in rolled_back)  # ones that closed
    # the last step read windows from a later page than the new end does: only max_rollback kept them
    assert (end // PAGE * PAGE - model.window_reach()) // PAGE < (PROMPT + DECODED - 1 - model.window_reach()) // PAGE

    cache = Cache(model, prompt, max_rollback=ROLLED_BACK)
    cache.step(prompt)
    cache.decode(decoded)
    cache.rollback(end)
    cache.m.check_consistency()
    got = cache.decode(continuation)

    fresh = Cache(model, prompt)
    fresh.step(prompt)
    fresh.decode(decoded[:end - PROMPT])
    want = fresh.decode(continuation)
    for position, (g, w) in enumerate(zip(got, want), start=end):
        assert torch.equal(g, w), f"position {position}: logits differ by {(g - w).abs().max().item():.3e}"

