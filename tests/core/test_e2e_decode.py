"""benchmarks/e2e_decode.py where no GPU is needed: it imports, and E2E_PRESETS picks or refuses presets."""

from __future__ import annotations

import pytest

from benchmark_script import load


@pytest.fixture(scope="module")
def e2e():
    return load("e2e_decode")


def test_presets_pick_cases_in_their_order(e2e):
    names = [preset for preset, _ in e2e.CASES]
    assert e2e._cases(None) == e2e._cases("") == e2e.CASES
    assert e2e._cases(",".join(reversed(names))) == e2e.CASES
    assert e2e._cases(names[-1]) == (e2e.CASES[-1],)


def test_unknown_preset_is_refused_by_name(e2e):
    with pytest.raises(ValueError, match=r"E2E_PRESETS: unknown \['no-such-model'\]"):
        e2e._cases("qwen3-0.6b,no-such-model")


def test_top_p_differs_from_greedy_only_in_sampling(e2e):
    import dataclasses

    greedy, top_p = dataclasses.asdict(e2e.GREEDY), dataclasses.asdict(e2e.TOP_P)
    assert {k for k in greedy if greedy[k] != top_p[k]} == {"temperature", "top_p", "seed"}
    assert top_p["seed"] is not None and top_p["ignore_eos"]


def test_fp8_preset_is_the_bf16_checkpoint_in_the_fp8_layout(e2e, tmp_path):
    """``<preset>-fp8``: the preset's checkpoint, written once, then in the fine-grained FP8 layout."""
    import json

    import torch

    bf16 = e2e._checkpoint(tmp_path, "tiny-llama", torch.device("cpu"))
    fp8 = e2e._checkpoint(tmp_path, "tiny-llama-fp8", torch.device("cpu"))
    assert bf16 == tmp_path / "tiny-llama" and fp8 == tmp_path / "tiny-llama-fp8"
    assert "quantization_config" not in json.loads((bf16 / "config.json").read_text())
    assert json.loads((fp8 / "config.json").read_text())["quantization_config"]["weight_block_size"] == [128, 128]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-llama", "tiny-llama-fp8"]
