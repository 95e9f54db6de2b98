"""benchmarks/dsv4_decode.py where no GPU is needed: case selection, the roofline's arithmetic, the
resident parts of a real (tiny, published-layout) model, the budget, the JSON's rows, and the whole
run at a tiny shape."""

from __future__ import annotations

import importlib.util
import math
import random
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "dsv4_decode.py"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        spec = importlib.util.spec_from_file_location("dsv4_decode", SCRIPT)
        module = sys.modules["dsv4_decode"] = importlib.util.module_from_spec(spec)  # its dataclass looks it up
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("dsv4_decode", None)
        sys.path.remove(str(SCRIPT.parent))


def test_env_selects_cases_and_refuses_unknown_names(bench):
    assert bench.env_list("DSV4_BATCHES", {}) == [1, 8, 32, 128, 256]
    assert bench.env_list("DSV4_CONTEXTS", {}) == [1024, 16384]
    assert bench.env_list("DSV4_PREFILLS", {}) == [1024, 4096, 8192]
    assert bench.env_list("DSV4_VARIANTS", {}, bench.VARIANTS) == ["fp8_fp4", "bf16"]  # the native one only on ask
    assert bench.env_list("DSV4_BATCHES", {"DSV4_BATCHES": " 32, 1"}) == [32, 1]
    assert bench.env_list("DSV4_VARIANTS", {"DSV4_VARIANTS": "bf16_native"}, bench.VARIANTS) == ["bf16_native"]
    with pytest.raises(ValueError, match=r"DSV4_VARIANTS: unknown \['fp4'\]"):
        bench.env_list("DSV4_VARIANTS", {"DSV4_VARIANTS": "bf16,fp4"}, bench.VARIANTS)
    with pytest.raises(ValueError, match="DSV4_CONTEXTS must be positive integers"):
        bench.env_list("DSV4_CONTEXTS", {"DSV4_CONTEXTS": "1K"})


def _config(bench, layer_types):
    return {**bench.FLASH, "layer_types": layer_types}


def test_kv_a_step_reads(bench, seed):
    """Per layer: the window's KV; CSA: every indexer key and the top-k entries; HCA: every entry."""
    c = _config(bench, [bench.SLIDING, bench.CSA, bench.HCA])
    context = random.randint(1, 20000)
    window = min(context, 128) * 512
    csa = window + context // 4 * 128 + min(context // 4, 512) * 512
    hca = window + context // 128 * 512
    assert bench.kv_read_per_sequence(c, context) == 2 * (window + csa + hca)
    assert bench.kv_read_per_sequence(c, 100) == 2 * 100 * 512 * 3 + 2 * 25 * (128 + 512)
    # E4M3 indexer keys with their fp32 scales, as kept beside the published FP8 weights
    assert bench.kv_read_per_sequence(c, context, index_key_bytes=132) == 2 * (window + csa + hca) - (
        context // 4 * (2 * 128 - 132))


def test_step_bytes_pick_experts_by_batch(bench, seed):
    c = _config(bench, [bench.CSA])
    layers = random.randint(1, 4)
    parts = {"dense": [random.randint(1, 10**9) for _ in range(layers)],
             "experts": [256 * random.randint(1, 10**7) for _ in range(layers)],
             "embedding": 10**9, "rest": random.randint(1, 10**8)}
    fixed = parts["rest"] + sum(parts["dense"])
    kv = bench.kv_read_per_sequence(c, 1024)
    assert bench.step_bytes(parts, c, 1, 1024) == round(fixed + sum(parts["experts"]) * 6 / 256 + kv)
    assert bench.step_bytes(parts, c, 4096, 1024) == pytest.approx(fixed + sum(parts["experts"]) + 4096 * kv)
    assert bench.roofline_ms(4_000_000_000, 4000.0) == pytest.approx(1.0)


@pytest.fixture(scope="module")
def published(shared_dir, tmp_path_factory):
    from engine.core.models.deepseek_v4.publish import write_published

    path = tmp_path_factory.mktemp("dsv4bench") / "published"
    write_published(shared_dir / "models" / "tiny-dsv4-py", path)
    return path


def test_resident_parts_of_the_published_layout(bench, published):
    """tiny-dsv4-py written as published and loaded: the parts add up to the bytes resident, the
    routed experts (FP4) are counted per layer, the embedding apart."""
    import torch

    from engine import LLM
    from engine.core.models.weights import resident_bytes

    model_components = LLM(str(published), device="cpu", dtype="float32", progress=False).engine.components
    model = model_components.model
    hf = model.config.hf
    parts = bench.resident_parts(model.named_parameters(), hf["n_routed_experts"], hf["num_hidden_layers"])
    held, _ = resident_bytes(model)
    assert parts["embedding"] + parts["rest"] + sum(parts["dense"]) + sum(parts["experts"]) == held
    stack = dict(model.named_parameters())["model.layers.0.ffn.experts.gate_up"]
    assert stack.dtype == torch.uint8
    per_expert = sum(p.numel() * p.element_size() // p.shape[0] for n, p in model.named_parameters()
                     if n.startswith("model.layers.0.ffn.experts."))
    assert parts["experts"][0] == per_expert * hf["n_routed_experts"] > 0
    assert parts["embedding"] == hf["vocab_size"] * hf["hidden_size"] * 4
    assert bench.index_key_bytes(model_components) == hf["index_head_dim"] + 4  # E4M3 and an fp32 scale


def test_a_decode_step_s_kernels_are_those_beyond_one_token(bench, seed):
    rng = random.Random(seed)
    names = [f"k{i}" for i in range(12)]
    prefill = {k: (rng.randint(1, 5), rng.uniform(0.01, 2)) for k in rng.sample(names, 8)}
    step = {k: (rng.randint(1, 4), rng.uniform(0.001, 0.1)) for k in rng.sample(names, 6)}
    n = rng.randint(1, 40)

    def profile(steps: int) -> dict:
        rows = {k: [0, 0.0] for k in {**prefill, **step}}
        for part, times in ((prefill, 1), (step, steps)):
            for k, (count, ms) in part.items():
                rows[k][0] += count * times
                rows[k][1] += ms * times
        return {"top": [{"kernel": k, "per_run": c, "ms_per_run": ms} for k, (c, ms) in rows.items() if c]}

    got = bench.kernels_beyond(profile(1 + n), profile(1), n)
    assert {k["kernel"] for k in got["top"]} == set(step)
    for k in got["top"]:
        count, ms = step[k["kernel"]]
        assert k["per_run"] == pytest.approx(count, abs=0.1) and k["ms_per_run"] == pytest.approx(ms, abs=2e-4)
    assert [k["ms_per_run"] for k in got["top"]] == sorted((k["ms_per_run"] for k in got["top"]), reverse=True)
    assert got["per_run"] == pytest.approx(sum(c for c, _ in step.values()), abs=0.1)


def test_budget_records_errors_and_skips(bench):
    result = {"errors": {}, "seconds": {}}
    budget = bench.Budget(result, 60)
    assert budget.attempt("ok", lambda: 3) == 3
    assert budget.attempt("fails", lambda: 1 / 0) is None
    assert budget.attempt("long", lambda: 1, expected_s=3600) is None
    with pytest.raises(bench.Stopped):  # a timeout's SIGTERM ends the run, which writes what it has
        budget.attempt("stopped", bench._stop)
    budget.deadline = time.monotonic() - 1
    assert budget.attempt("late", lambda: 1) is None
    assert result["errors"]["fails"].startswith("ZeroDivisionError")
    assert result["errors"]["long"].startswith("skipped: past the time budget (about 3600 s expected")
    assert result["errors"]["late"] == "skipped: past the time budget"
    assert "ok" not in result["errors"] and "stopped" not in result["errors"]
    assert set(result["seconds"]) == {"ok", "fails", "stopped"}  # skipped parts take none


def test_rows_cheapest_first_and_summary(bench):
    rows = bench._rows([8, 1], [16384, 1024], [8192, 1024], _config(bench, [bench.CSA]))
    assert rows["decode_cases"] == [(1, 1024), (8, 1024), (1, 16384), (8, 16384)]
    assert rows["prefills"] == [1024, 8192]
    row = rows["decode"][8, 1024]
    row.update(bf16_step_ms=4.0, hf_step_ms=20.0, roofline={"bf16": 1.0})
    rows["prefill"][1024] = {"prompt_len": 1024, "bf16_prefill_tok_s": 5000.0, "hf_prefill_tok_s": 1000.0}
    out = bench.summarize(rows, ["bf16", "fp8_fp4"])
    got = next(r for r in out["decode"] if r["variant"] == "bf16" and r["batch"] == 8 and r["context"] == 1024)
    assert got["fraction_of_roofline"] == 0.25 and got["engine_vs_hf"] == 5.0 and got["decode_tokens"] == 16
    assert len(out["decode"]) == 8 and all("engine_vs_hf" not in r for r in out["decode"] if r["variant"] == "fp8_fp4")
    assert next(r for r in out["prefill"] if r["variant"] == "bf16")["engine_vs_hf"] == 5.0


def test_hf_skips_what_its_attention_cannot_hold(bench):
    assert bench.hf_skip_reason(32, 1024) is None and bench.hf_skip_reason(1, 8192) is None
    assert "16384 tokens" in bench.hf_skip_reason(1, 16384)
    assert "256 x 1024" in bench.hf_skip_reason(256, 1024)


@pytest.mark.slow
def test_whole_run_on_a_tiny_shape(bench, shared_dir, monkeypatch):
    """run() end to end on the CPU at tiny-dsv4-py's widths with V4-Flash's window and compress
    rates, four layers (two sliding, CSA, HCA), on page-aligned 256-token prompts (past the window
    of 128 and two HCA windows, as the device run's 1024 are; its 16 decode tokens are 2 here, which
    is all a decode rate needs): HF builds, saves and measures, the published copy is written, both
    variants load and measure, and every decode row's prompts hit the prefix cache the warm-up left
    (all but the last page)."""
    import json
    import signal

    import torch

    tiny = json.loads((shared_dir / "models" / "tiny-dsv4-py" / "config.json").read_text())
    shape = {k: tiny[k] for k in [*bench.FLASH, "partial_rotary_factor", "qk_rope_head_dim", "rope_parameters"]}
    shape.update(sliding_window=bench.FLASH["sliding_window"], compress_rates=bench.FLASH["compress_rates"])
    # the budget is the device run's; a busy CPU must not skip a row of this one
    env = {"DSV4_BATCHES": "1,2", "DSV4_CONTEXTS": "256", "DSV4_PREFILLS": "256", "DSV4_BUDGET_S": "3600"}
    monkeypatch.setattr(bench, "decode_tokens", lambda batch: 2)
    handler = signal.getsignal(signal.SIGTERM)
    result = bench.run(torch.device("cpu"), {"copy_gb_s": 0.1}, shape, layers=4, env=env)
    assert signal.getsignal(signal.SIGTERM) == handler
    assert result["errors"] == {}, result["errors"]
    assert result["published"]["fp8"] > 0 and result["published"]["fp4"] > 0
    assert result["variants"]["fp8_fp4"]["bytes_per_parameter"] < result["variants"]["bf16"]["bytes_per_parameter"]
    assert result["variants"]["bf16"]["backends"]["moe"] == "native"  # what the CPU platform picks
    decode = {(r["variant"], r["batch"]): r for r in result["decode"]}
    assert decode.keys() == {(v, b) for v in ("fp8_fp4", "bf16") for b in (1, 2)}
    # every row carries its ratios; their signs are not asserted: at this shape a decode rate is a
    # difference of two timings of a few ms, which a busy CPU can turn negative (CI: -18.45)
    for r in result["decode"] + result["prefill"]:
        assert math.isfinite(r["engine_vs_hf"]) and r["engine_vs_hf"] != 0
    assert all(math.isfinite(r["fraction_of_roofline"]) and r["step_ms"] != 0 for r in result["decode"])
    for v in ("fp8_fp4", "bf16"):
        assert decode[v, 2]["roofline_step_ms"] > decode[v, 1]["roofline_step_ms"]
    assert decode["fp8_fp4", 1]["roofline_step_ms"] < decode["bf16", 1]["roofline_step_ms"]
    assert result["variants"]["fp8_fp4"]["index_key_bytes"] == shape["index_head_dim"] + 4
    assert result["variants"]["bf16"]["index_key_bytes"] in (2 * shape["index_head_dim"], 4 * shape["index_head_dim"])
    assert not list(Path(result["checkpoint_folder"]).glob("engine-dsv4-*"))  # the checkpoints are removed
