"""``engine train-drafter --method mtp``: it writes a drafter directory the MTP proposer loads (and
refuses for another model), and the next-n layer trained for tiny-dsv4-py kept in tests/assets
keeps drafts on held-out text while the output stays the target's."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from engine import LLM
from engine.core.spec.config import SpecConfigError
from test_spec_decode import completions, greedy, text_ids

ASSET = Path(__file__).resolve().parents[2] / "assets" / "tiny-dsv4-py-mtp"


def train_drafter(target, method: str, out, seed: int, *flags: str) -> subprocess.CompletedProcess:
    """``engine train-drafter`` on the json package's sources in tiny steps, as a user runs it; it must succeed."""
    data = Path(sysconfig.get_paths()["stdlib"]) / "json"
    res = subprocess.run([sys.executable, "-m", "engine.server.cli", "train-drafter", "--model", str(target),
                          "--method", method, "--data", str(data), "--out", str(out), "--seq-len", "32",
                          "--batch-size", "2", "--max-tokens", "4000", "--seed", str(seed), *flags],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    return res


def mtp(target, drafter, **kw) -> LLM:
    return LLM(str(target), dtype="float32", page_size=4, num_pages=400, chunked_prefill_size=16, progress=False,
               speculative_config={"method": "mtp", "num_speculative_tokens": 3, "model": str(drafter)}, **kw)


@pytest.fixture(scope="module")
def target(shared_dir):
    return shared_dir / "models" / "tiny-dsv4-py"


@pytest.fixture(scope="module")
def plain(target):
    return LLM(str(target), dtype="float32", page_size=4, num_pages=400, chunked_prefill_size=16, progress=False,
               enable_prefix_caching=False)


def test_train_drafter_writes_a_drafter_the_mtp_proposer_loads(target, plain, tmp_path, eval_text, seed):
    out = tmp_path / "drafter"
    res = train_drafter(target, "mtp", out, seed, "--steps", "3")
    assert "trained 3 steps on 192 tokens" in res.stdout and "training the next-n layer" in res.stderr
    meta = json.loads((out / "drafter.json").read_text())
    assert meta["method"] == "mtp" and meta["target_name"] == "tiny-dsv4-py" and meta["steps"] == 3
    prompts = [text_ids(plain, eval_text, 24) for _ in range(2)]
    spec = mtp(target, out)
    assert completions(spec.generate(prompts, greedy(16))) == completions(plain.generate(prompts, greedy(16)))
    assert spec.engine.speculator.counters.num_draft_tokens > 0


def test_the_trained_next_n_layer_keeps_drafts_and_the_targets_output(target, plain, eval_text, seed):
    spec = mtp(target, ASSET)
    prompts = [text_ids(plain, eval_text, 48) for _ in range(6)]
    params = greedy(32)
    assert completions(spec.generate(prompts, params)) == completions(plain.generate(prompts, params))
    c = spec.engine.speculator.counters
    assert c.num_drafts > 30 and c.mean_acceptance_length > 1.2, c


def test_a_drafter_for_another_model_or_method_is_refused_at_start_up(target, shared_dir, tmp_path):
    cases = [("target", "0" * 64, "is a drafter for another model (tiny-dsv4-py)"),
             ("method", "dspark", "is a 'dspark' drafter, not 'mtp'")]
    for key, value, reason in cases:
        bad = tmp_path / key
        shutil.copytree(ASSET, bad)
        meta = json.loads((bad / "drafter.json").read_text())
        (bad / "drafter.json").write_text(json.dumps({**meta, key: value}))
        with pytest.raises(SpecConfigError, match="speculative_config.method: 'mtp' cannot run here") as err:
            mtp(target, bad)
        assert reason in str(err.value)


@pytest.mark.gpu
def test_on_cuda_the_trained_next_n_layer_keeps_drafts_and_the_targets_output(target, eval_text, seed):
    """fp32 on the CUDA backends (steps that hand back the streams replay prefill graphs)."""
    plain = LLM(str(target), dtype="float32", page_size=4, num_pages=400, device="cuda", progress=False,
                enable_prefix_caching=False)
    spec = mtp(target, ASSET, device="cuda")
    prompts = [text_ids(plain, eval_text, 48) for _ in range(6)]
    params = greedy(32)
    assert completions(spec.generate(prompts, params)) == completions(plain.generate(prompts, params))
    assert spec.engine.speculator.counters.mean_acceptance_length > 1.2
