"""Programmatic dependent launch: where it is on, and that a graph of dependent PDL kernels still
computes what the kernels compute one after another."""

from __future__ import annotations

import pytest
import torch

from engine.backends.triton import pdl
from engine.backends.triton.gemv import gemv
from engine.backends.triton.norm import add_rms_norm


@pytest.fixture
def fresh_options():
    pdl.reset()
    yield
    pdl.reset()


def test_off_for_the_interpreter_and_when_switched_off(fresh_options, monkeypatch):
    assert pdl.launch_options(torch.device("cpu")) == {"PDL": False}
    if torch.cuda.is_available():
        monkeypatch.setenv("ENGINE_PDL", "0")
        pdl.reset()
        assert pdl.launch_options(torch.device("cuda", 0)) == {"PDL": False}


@pytest.mark.gpu
def test_on_for_hopper_and_later(fresh_options):
    device = torch.device("cuda", 0)
    want = torch.cuda.get_device_capability(device)[0] >= 9 and not torch.version.hip
    assert pdl.launch_options(device) == ({"PDL": True, "launch_pdl": True} if want else {"PDL": False})


def _chain(x, residual, weights, norm_weight):
    """Each layer reads what the one before wrote: a GEMV, then the residual add and norm."""
    for w in weights:
        x = gemv(x, w)
        x, residual = add_rms_norm(x, residual, norm_weight, 1e-6)
    return x, residual


@pytest.mark.gpu
def test_graph_of_dependent_pdl_kernels(seed, fresh_options, monkeypatch):
    """New inputs every replay: a kernel that did not wait for the one before would read the last
    replay's values (or the poison). The same kernels launched one after another without PDL do
    the same arithmetic, so the results must be equal to the bit."""
    torch.manual_seed(seed)
    hidden, layers = 4096, 24
    weights = [torch.randn(hidden, hidden, dtype=torch.bfloat16, device="cuda") / hidden ** 0.5 for _ in range(layers)]
    norm_weight = (1 + 0.1 * torch.randn(hidden, device="cuda")).to(torch.bfloat16)
    x = torch.empty(1, hidden, dtype=torch.bfloat16, device="cuda")
    residual = torch.empty_like(x)
    x.normal_(), residual.normal_()
    _chain(x, residual, weights, norm_weight)  # compiles every kernel outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, out_residual = _chain(x, residual, weights, norm_weight)
    inputs = [(torch.randn_like(x), torch.randn_like(x)) for _ in range(4)]
    got = []
    for a, b in inputs:
        x.copy_(a), residual.copy_(b)
        out.fill_(float("nan")), out_residual.fill_(float("nan"))
        graph.replay()
        got.append((out.clone(), out_residual.clone()))
    monkeypatch.setenv("ENGINE_PDL", "0")
    pdl.reset()
    for (a, b), (o, r) in zip(inputs, got):
        want, want_residual = _chain(a, b, weights, norm_weight)
        assert torch.equal(o, want) and torch.equal(r, want_residual)
