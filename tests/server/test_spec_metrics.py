"""Speculative decoding's totals cross from the engine process to /metrics under vLLM's names, and
a server without speculation shows none of them."""

from __future__ import annotations

import random

from engine.core.spec.counters import SpecCounters
from engine.server import wire
from engine.server.metrics import ServerMetrics


def samples(text: str) -> dict[str, float]:
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def test_spec_counters_reach_metrics_through_the_wire(seed):
    k = random.randint(1, 8)
    per_position = sorted((random.randint(0, 500) for _ in range(k)), reverse=True)
    counters = SpecCounters(random.randint(per_position[0], 900), 0, sum(per_position), per_position)
    counters.num_draft_tokens = counters.num_drafts * k
    sent = wire.Outputs([], wire.Stats(num_running=1, spec=counters))
    got = wire.from_engine_decoder.decode(wire.encoder.encode(sent)).stats
    m = samples(ServerMetrics("m", 16, 100).render(got, 0))
    label = 'model_name="m"'
    assert m[f"engine:spec_decode_num_drafts_total{{{label}}}"] == counters.num_drafts
    assert m[f"engine:spec_decode_num_draft_tokens_total{{{label}}}"] == counters.num_draft_tokens
    assert m[f"engine:spec_decode_num_accepted_tokens_total{{{label}}}"] == counters.num_accepted_tokens
    for i, c in enumerate(per_position):
        assert m[f'engine:spec_decode_num_accepted_tokens_per_pos{{{label},position="{i}"}}'] == c
    assert counters.mean_acceptance_length == 1 + counters.num_accepted_tokens / counters.num_drafts

    plain = ServerMetrics("m", 16, 100).render(wire.Stats(num_running=1), 0)
    assert "spec_decode" not in plain and "engine:num_requests_running" in plain
