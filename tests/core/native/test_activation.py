"""silu_and_mul against HF's LlamaMLP activation on separate gate and up projections."""

from __future__ import annotations

import pytest
import torch
from transformers.activations import ACT2FN

from engine.core.native.activation import silu_and_mul


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_hf_gate_times_up(seed, dtype):
    gate, up = torch.randn(3, 5, 24).to(dtype) * 4, torch.randn(3, 5, 24).to(dtype)
    out = silu_and_mul(torch.cat([gate, up], dim=-1))
    assert out.shape == (3, 5, 24) and out.dtype == dtype
    # equal up to one ulp: torch's silu takes other code paths on strided and contiguous inputs
    ulp = 1e-6 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(out, ACT2FN["silu"](gate) * up, rtol=ulp, atol=1e-6)
    torch.testing.assert_close(out.float(), gate.float() * torch.sigmoid(gate.float()) * up.float(),
                               rtol=2e-2, atol=2e-2)
