"""A speculative config the engine cannot run fails at start-up, naming the field: in ``LLM``, in
``engine generate`` and ``engine serve`` (``--speculative-config JSON``)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine import LLM
from engine.core.config import EngineConfig
from engine.core.spec.config import MAX_SPECULATIVE_TOKENS, SpecConfigError, SpeculativeConfig

NGRAM = {"method": "ngram", "num_speculative_tokens": 3}


@pytest.mark.parametrize("bad, field", [
    ({**NGRAM, "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({**NGRAM, "num_speculative_tokens": MAX_SPECULATIVE_TOKENS + 1}, "num_speculative_tokens"),
    ({**NGRAM, "num_speculative_tokens": "3"}, "num_speculative_tokens"),
    ({**NGRAM, "num_speculative_tokens": True}, "num_speculative_tokens"),
    ({**NGRAM, "num_speculative_tokens": 2.0}, "num_speculative_tokens"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"num_speculative_tokens": 2}, "method"),
    ({**NGRAM, "method": ""}, "method"),
    ({**NGRAM, "method": 3}, "method"),
    ({**NGRAM, "prompt_lookup_min": 0}, "prompt_lookup_min"),
    ({**NGRAM, "prompt_lookup_max": -1}, "prompt_lookup_max"),
    ({**NGRAM, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({**NGRAM, "prompt_lookup_min": "2"}, "prompt_lookup_min"),
    ({**NGRAM, "model": ""}, "model"),
    ({**NGRAM, "num_lookahead": 2}, "num_lookahead"),
    ({**NGRAM, "Method": "ngram"}, "Method"),
    ([NGRAM], None),
    ("{method: ngram}", None),
])
def test_a_bad_config_names_its_field(bad, field):
    want = f"speculative_config.{field}:" if field else "speculative_config:"
    with pytest.raises(SpecConfigError, match=want.replace(".", r"\.")) as err:
        SpeculativeConfig.of(bad)
    assert err.value.field == want[:-1]
    with pytest.raises(SpecConfigError, match=want.replace(".", r"\.")):
        EngineConfig(model="m", speculative_config=bad)


def test_ngram_lookup_bounds_default_as_vllms():
    assert SpeculativeConfig.of(NGRAM).prompt_lookup_min == SpeculativeConfig.of(NGRAM).prompt_lookup_max == 5
    one = SpeculativeConfig.of({**NGRAM, "prompt_lookup_max": 3})
    assert (one.prompt_lookup_min, one.prompt_lookup_max) == (3, 3)
    one = SpeculativeConfig.of({**NGRAM, "prompt_lookup_min": 2})
    assert (one.prompt_lookup_min, one.prompt_lookup_max) == (2, 2)
    spec = EngineConfig(model="m", speculative_config='{"method": "ngram", "num_speculative_tokens": 4, '
                                                      '"prompt_lookup_min": 1, "prompt_lookup_max": 3}').speculative_config
    assert spec == SpeculativeConfig("ngram", 4, 1, 3)


def test_drafts_must_fit_the_step_budget():
    with pytest.raises(SpecConfigError, match="num_speculative_tokens: 4 drafts .* max_num_batched_tokens 4"):
        EngineConfig(model="m", max_num_batched_tokens=4, speculative_config={**NGRAM, "num_speculative_tokens": 4})
    EngineConfig(model="m", max_num_batched_tokens=5, speculative_config={**NGRAM, "num_speculative_tokens": 4})


@pytest.mark.parametrize("method", ["eagle", "medusa"])
def test_a_method_without_a_proposer_fails_at_start_up(tiny_qwen3, method):
    with pytest.raises(SpecConfigError, match=f"speculative_config.method: no proposer '{method}' is registered"):
        LLM(str(tiny_qwen3), speculative_config={"method": method, "num_speculative_tokens": 2, "model": "d"},
            progress=False)


def engine_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine.server.cli", *args], capture_output=True, text=True,
                          timeout=120)


def test_the_command_line_refuses_a_bad_config_naming_the_field(tiny_qwen3):
    res = engine_cli("generate", "--model", str(tiny_qwen3), "--prompt", "x",
                     "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 99}')
    assert res.returncode == 2
    assert "argument --speculative-config: speculative_config.num_speculative_tokens: must be an integer" in res.stderr
    res = engine_cli("serve", "--model", str(tiny_qwen3), "--port", "1",
                     "--speculative-config", '{"method": "ngram", "k": 2}')
    assert res.returncode == 2 and "speculative_config.k: unknown key" in res.stderr


def test_serve_with_a_method_without_a_proposer_exits_at_start_up(tiny_qwen3):
    res = engine_cli("--log-level", "WARNING", "serve", "--model", str(tiny_qwen3), "--port", "1",
                     "--speculative-config", '{"method": "eagle", "num_speculative_tokens": 2}')
    assert res.returncode != 0
    assert "the engine failed to start: SpecConfigError: speculative_config.method: no proposer 'eagle'" in res.stderr
