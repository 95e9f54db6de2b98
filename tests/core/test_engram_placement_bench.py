"""benchmarks/engram_placement.py where no GPU is needed: the whole run at a tiny stack on the CPU
(a random checkpoint with V4.1-Flash's Engram row shape, every variant decoding), so the device
run meets no error of its own."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "engram_placement.py"
TINY = {"hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 2, "head_dim": 16, "qk_rope_head_dim": 8,
        "q_lora_rank": 16, "o_groups": 2, "o_lora_rank": 8, "n_routed_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 16, "index_n_heads": 4, "index_head_dim": 8, "index_topk": 4, "sliding_window": 8,
        "hc_mult": 2}


def test_the_benchmark_runs_every_variant_at_a_tiny_shape():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        spec = importlib.util.spec_from_file_location("engram_placement", SCRIPT)
        bench = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(bench)
        result = bench.run(torch.device("cpu"), TINY, engram_vocab=31, batches=(1, 2), tokens=2, prompt_len=6)
    finally:
        sys.path.remove(str(SCRIPT.parent))
    assert result["engram_layers"] == [1] and result["rows_per_token_per_layer"] == 24
    assert [(r["variant"], r["batch"]) for r in result["decode"]] == [(v, b) for v in bench.VARIANTS for b in (1, 2)]
    assert all(isinstance(r["step_ms"], float) and r["graphs"] is False for r in result["decode"])  # CPU: eager
    assert len(bench._lines(result)) == 1 + len(result["decode"])
