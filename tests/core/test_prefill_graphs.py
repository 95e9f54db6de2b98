"""Prefill steps through breakable graphs on the CPU, with the graphs backend that records torch
operations (core/native/graphs.py): the segments and breaks of a recorded forward, the buffers
the breaks write, the padding, and whole generations against eager engines."""

from __future__ import annotations

import logging
import random
from dataclasses import replace

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.breaks import Break
from engine.core.families.attention import AttentionLayer
from engine.core.forward import ForwardBatch
from engine.core.native.graphs import RecordedOps
from engine.core.prefill_graphs import PrefillGraphs, prefill_buckets
from engine.core.startup import capture_prefill_graphs

PAGE = 4
OPTS = dict(dtype="float32", page_size=PAGE, num_pages=256, chunked_prefill_size=16, max_num_batched_tokens=32,
            max_num_seqs=4, max_model_len=128, progress=False)


@pytest.fixture(scope="module")
def qwen3(tiny_qwen3):
    """A graphed engine (buckets 16 and 32) and an eager one."""
    return LLM(str(tiny_qwen3), graph_backend="recorded", **OPTS), LLM(str(tiny_qwen3), **OPTS)


def _prompts(tok, text: str, lengths: list[int]) -> list[list[int]]:
    starts = random.sample(range(len(text) - 2000), len(lengths))
    return [tok.encode(text[s:s + 1000])[:n] for s, n in zip(starts, lengths)]


def _generate_both(graphed: LLM, eager: LLM, eval_text: str, counted: list, lengths: list[int], hit: int) -> None:
    """Prompts chunked, several to a step, then one whose first ``hit`` tokens the last left cached:
    equal greedy tokens."""
    first = _prompts(eager.tokenizer, eval_text, lengths)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    for prompts in (first, [first[-1][:hit] + first[0]]):
        got, want = graphed.generate(prompts, params), eager.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert got[0].num_cached_tokens == hit
    assert counted, "no step went through a prefill graph"


def _count_runs(monkeypatch, graphs) -> list:
    runs = []
    real = graphs.run
    monkeypatch.setattr(graphs, "run", lambda batch, *a: runs.append(batch.num_tokens) or real(batch, *a))
    return runs


def test_greedy_tokens_equal_eager_on_qwen3(qwen3, eval_text, seed, monkeypatch):
    graphed, eager = qwen3
    graphs = graphed.engine.runner.prefill_graphs
    assert graphs is not None and graphs.buckets == [16, 32]
    runs = _count_runs(monkeypatch, graphs)
    _generate_both(graphed, eager, eval_text, runs, [3, 21, 45], 40)
    assert max(runs) > 16  # the larger bucket too


def test_greedy_tokens_equal_eager_on_dsv4(shared_dir, eval_text, seed, monkeypatch):
    """Its window store, compressors, indexer and attention in the breaks, the native MoE too (it
    sizes its experts' slices on the host); one bucket of 16 tokens keeps the capture short."""
    model = str(shared_dir / "models" / "tiny-dsv4-py")
    opts = {**OPTS, "max_num_batched_tokens": 16}
    graphed, eager = LLM(model, graph_backend="recorded", **opts), LLM(model, **opts)
    graphs = graphed.engine.runner.prefill_graphs
    assert graphs is not None and graphs.buckets == [16]
    calls = [b.call.__name__ for b in graphs.recorder(16).breaks]
    assert calls[0] == "prepare"
    assert {"store", "store_and_compress", "store_compress_and_select", "attend"} <= set(calls)
    assert {"experts", "route_experts"} & set(calls)
    _generate_both(graphed, eager, eval_text, _count_runs(monkeypatch, graphs), [3, 22], 20)


def test_segments_alternate_with_the_attention_calls_in_layer_order(qwen3):
    graphs = qwen3[0].engine.runner.prefill_graphs
    layers = len(qwen3[0].engine.components.model.model.layers)
    for b in graphs.buckets:
        steps = graphs.recorder(b).steps
        assert len(steps) == 2 * layers + 1
        assert all(isinstance(s, Break) == (i % 2 == 1) for i, s in enumerate(steps))
        breaks = graphs.recorder(b).breaks
        assert [brk.call.__name__ for brk in breaks] == ["rope_forward"] * layers
        ids = [next(a.layer_id for a in brk.args if isinstance(a, AttentionLayer)) for brk in breaks]
        assert ids == list(range(layers))


def test_bucket_choice():
    assert prefill_buckets(100) == [16, 32, 64, 100]
    assert prefill_buckets(16) == [16]
    big = prefill_buckets(8192)
    assert big[:6] == [16, 32, 64, 128, 256, 512] and big[6:9] == [1024, 1536, 2048] and big[-1] == 8192
    assert all(b - a == 512 for a, b in zip(big[5:], big[6:]))


def _kv_state(kv) -> list[torch.Tensor]:
    return [t.clone() for i in range(kv.num_layers) for t in (kv.layer(i).k, kv.layer(i).v)]


def test_a_step_fills_its_bucket_and_writes_only_its_tokens_pages(qwen3, seed, monkeypatch):
    """Two sequences, one after a cached prefix: n tokens run the smallest bucket over n. Each
    break's buffer holds the eager attention output in its first n rows, zeros after; the KV pages
    end as an eager step leaves them, so the padding wrote none."""
    engine = qwen3[0].engine
    graphs, model, kv = engine.runner.prefill_graphs, engine.components.model, engine.components.kv
    rng = random.Random(seed)
    new = [rng.randint(2, 9), rng.randint(2, 12)]
    n, context = sum(new), [0, rng.randint(1, 8)]
    bucket = graphs.bucket(n)
    assert bucket == min(b for b in graphs.buckets if b >= n)
    tables = [[10, 11, 12], [20, 21, 22, 23, 24]]
    batch = ForwardBatch.build([rng.randrange(100, 2000) for _ in range(n)], new, context, tables, PAGE,
                               list(range(n)))
    batch.attn_metadata = model.prepare(batch)
    for i in range(kv.num_layers):  # garbage everywhere, so any write shows
        kv.layer(i).k.normal_()
        kv.layer(i).v.normal_()
    before = _kv_state(kv)

    attention = model.backends.attention.inner
    outputs = []
    real = attention.rope_forward
    monkeypatch.setattr(attention, "rope_forward", lambda *a, **k: outputs.append(real(*a, **k)) or outputs[-1])
    with torch.inference_mode():
        want = model(batch, kv)
    eager_kv = _kv_state(kv)
    monkeypatch.undo()
    for i in range(kv.num_layers):
        kv.layer(i).k.copy_(before[2 * i])
        kv.layer(i).v.copy_(before[2 * i + 1])

    with torch.inference_mode():
        got = graphs.run(batch)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(graphs.input_ids[:n], batch.input_ids) and not graphs.input_ids[n:bucket].any()
    assert len(outputs) == len(graphs.recorder(bucket).breaks) == len(model.model.layers)
    for brk, eager_out in zip(graphs.recorder(bucket).breaks, outputs):
        buffer = brk.outputs[0]
        assert buffer.shape[0] == bucket
        torch.testing.assert_close(buffer[:n], eager_out, rtol=1e-5, atol=1e-5)
        assert not buffer[n:].any()
    for g, e, b in zip(_kv_state(kv), eager_kv, before):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
        assert torch.equal(g != b, e != b)  # the same slots written, no others


@pytest.mark.parametrize("failure", ["host read", "result not per token"])
def test_a_failed_capture_is_logged_and_leaves_prefill_eager(qwen3, caplog, monkeypatch, failure):
    """A segment that reads a value on the host (as a CUDA capture refuses it), or a break whose
    result has no row per token, which no buffer can take; unless the user named the graphs
    backend: then the failure is theirs to see."""
    engine = qwen3[0].engine
    c, graphs = engine.components, engine.runner.prefill_graphs
    if failure == "host read":
        norm = c.model.model.norm
        real_norm = norm.add_forward
        monkeypatch.setattr(norm, "add_forward", lambda x, r: (float(x[0, 0]), real_norm(x, r))[1])
        why = "RuntimeError: a recorded segment read a tensor's value on the host"
    else:
        attention = c.model.backends.attention.inner
        real = attention.rope_forward
        monkeypatch.setattr(attention, "rope_forward", lambda *a, **k: real(*a, **k)[:1])
        why = "CaptureError: <lambda> returned a tensor of shape (1, 4, 64): a break's tensor results need a row " \
              "per token (16)"

    def capture(explicit: bool):
        return capture_prefill_graphs(engine.config, explicit, RecordedOps(None), graphs.points, c.model, c.kv,
                                      c.max_model_len, c.device, False)

    with caplog.at_level(logging.WARNING, logger="engine.core.startup"):
        assert capture(False) is None
    assert f"capturing prefill graphs failed ({why}" in caplog.text and "prefill runs eagerly" in caplog.text
    assert graphs.points.recorder is None
    with pytest.raises(RuntimeError, match="on the host|a row per token"):
        capture(True)


def test_a_bucket_out_of_memory_ends_the_capture_with_the_smaller_ones(qwen3, caplog, monkeypatch):
    engine = qwen3[0].engine
    c, points = engine.components, engine.runner.prefill_graphs.points
    model = c.model
    real = model.forward

    def forward(batch, kv):
        if batch.num_tokens == 32 and points.recorder is not None:
            raise torch.OutOfMemoryError("a stand-in for the device running out while recording")
        return real(batch, kv)

    monkeypatch.setattr(model, "forward", forward)
    graphs = PrefillGraphs(model, c.kv, RecordedOps(None), points, PAGE, 32, c.device)
    with caplog.at_level(logging.WARNING, logger="engine.core.prefill_graphs"):
        graphs.capture(progress=False)
    assert graphs.buckets == [16] and graphs.holds(16) and not graphs.holds(17)
    assert "a prefill graph of 32 tokens does not fit in memory: steps of more than 16 tokens run eagerly" \
        in caplog.text


def test_no_prefill_graphs_where_configured_so(qwen3, caplog):
    engine = qwen3[0].engine
    c = engine.components
    config = replace(engine.config, max_prefill_graph_tokens=0)
    with caplog.at_level(logging.INFO, logger="engine.core.startup"):
        assert capture_prefill_graphs(config, False, RecordedOps(None), engine.runner.prefill_graphs.points,
                                      c.model, c.kv, c.max_model_len, c.device, False) is None
    assert "no prefill graphs: max_prefill_graph_tokens is 0" in caplog.text
