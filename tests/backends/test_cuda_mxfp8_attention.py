"""DeepSeek-V4's MXFP8 attention output on a GPU: tiny-dsv4-py in bf16 with the attention emitting
MXFP8 into the grouped MXFP8 output projection (``mxfp8_attention=True``: on sm_90 the
dequantize-in-registers GEMM, on sm_100 and gfx950 the block-scaled MMA) against the same engine
with it off: logits and greedy continuations over held-out prompts within the bounds the CPU
figures set (tests/mxfp8_cost.py, README), which bf16's own noise loosens."""

from __future__ import annotations

import json

import pytest

from mxfp8_cost import ARGMAX_AGREEMENT, GREEDY_AGREEMENT, MAX_LOGIT_ERROR, MEAN_LOGIT_ERROR, mxfp8_cost

pytestmark = pytest.mark.gpu


def test_tiny_dsv4_mxfp8_attention_gpu(shared_dir, eval_text):
    figures = mxfp8_cost(str(shared_dir / "models" / "tiny-dsv4-py"), eval_text, "cuda", count=16, tokens=128,
                         new=16)
    print(json.dumps(figures))
    assert figures["logit_mean_abs_error"] < MEAN_LOGIT_ERROR
    assert figures["logit_max_abs_error"] < MAX_LOGIT_ERROR
    assert figures["argmax_agreement"] >= ARGMAX_AGREEMENT
    assert figures["greedy_agreement"] >= GREEDY_AGREEMENT
