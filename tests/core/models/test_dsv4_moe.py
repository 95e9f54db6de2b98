"""DeepSeek-V4's shared expert folded into the routed experts' launch (``FOLD_SHARED``) computes what
it computes in a launch of its own: the stack gains one expert, every token takes it with weight 1
(the routing's last column, sliced off for the separate launch)."""

from __future__ import annotations

import random

import torch

from engine.core.config import EngineConfig
from engine.core.models.deepseek_v4 import moe
from engine.core.startup import build
from packed_logits import engine_logits, rel_err

PAGE = 16


def test_folded_shared_expert_equals_separate(shared_dir, seed, monkeypatch):
    config = EngineConfig(model=str(shared_dir / "models" / "tiny-dsv4-py"), dtype="float32", page_size=PAGE,
                          num_pages=80)
    monkeypatch.setattr(moe, "FOLD_SHARED", False)
    separate = build(config, progress=False)
    monkeypatch.setattr(moe, "FOLD_SHARED", True)
    folded = build(config, progress=False)
    ffn = folded.model.model.layers[0].ffn
    assert ffn.shared_experts is None and ffn.experts.gate_up.shape[0] == ffn.num_experts + 1
    assert separate.model.model.layers[0].ffn.shared_experts is not None
    vocab = folded.model_config.vocab_size
    prompts = [[random.randrange(vocab) for _ in range(n)] for n in (1, random.randint(20, 90))]
    for p, got, want in zip(prompts, engine_logits(folded, prompts, PAGE), engine_logits(separate, prompts, PAGE)):
        err = rel_err(got, want)
        assert err < 1e-5, f"length {len(p)}: relative error {err:.2e}"  # one fp32 sum instead of two
