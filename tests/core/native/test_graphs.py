"""The CPU's graphs (core/native/graphs.py): a replay recomputes what was recorded on the same
tensors, whatever they hold then, and a host read of a value cannot be recorded."""

from __future__ import annotations

import pytest
import torch

from engine.core.native.graphs import RecordedOps


def test_a_replay_recomputes_on_the_new_contents():
    graphs, x, w = RecordedOps(None), torch.randn(6, 4), torch.randn(3, 4)
    acc = torch.zeros(6, 3)

    def step():
        y = torch.nn.functional.linear(x, w).view(2, 9)  # a view: aliases the product
        acc.add_(y.view(6, 3))  # in place, into a tensor from before the recording
        return y.float().relu().split([4, 5], 1)[1] * 2  # .float() of fp32 aliases; the split views

    replay = graphs.capture(step)
    for _ in range(3):
        before = acc.clone()
        x.normal_()
        w.normal_()
        want = (torch.nn.functional.linear(x, w).view(2, 9).relu().split([4, 5], 1)[1] * 2)
        got = replay()
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        torch.testing.assert_close(acc, before + torch.nn.functional.linear(x, w), rtol=0, atol=0)


@pytest.mark.parametrize("read", [lambda x: float(x[0]), lambda x: bool(x[1] > 0), lambda x: torch.equal(x, x)])
@pytest.mark.parametrize("inference", [False, True])
def test_a_segment_that_reads_a_value_on_the_host_is_refused(read, inference):
    graphs = RecordedOps(None)
    with torch.inference_mode(inference):
        x = torch.randn(4)
        graphs.begin_segment()
        with pytest.raises(RuntimeError, match="on the host"):
            read(x)
        graphs.end_segment()
        read(x)  # eager again


def test_selected_only_where_named_and_beside_torch_backends():
    from types import SimpleNamespace

    from engine.core.config import EngineConfig
    from engine.core.native.plugin import _recorded_reasons

    def reasons(**named):
        return _recorded_reasons(SimpleNamespace(engine_config=EngineConfig(model="m", **named)))

    assert "only where named" in reasons()[0]
    assert reasons(graph_backend="recorded", attention_backend="native") == []
    assert "the linear backend triton launches kernels of its own" in \
        reasons(graph_backend="recorded", linear_backend="triton")[0]
