"""HIP graphs on the ROCm platform, checked on this CPU host with the platform faked as
tests/core/test_plugins.py fakes it: what torch's ROCm build reports. The capture itself is
CudaGraphs' code, which the `gpu` tests of tests/backends/test_cuda_*graphs.py run."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

from engine.backends.cuda.graphs import CudaGraphs
from engine.backends.rocm.graphs import HipGraphs, rocm_version
from engine.core.config import EngineConfig
from engine.core.platform import PlatformSpec
from engine.core.plugins import load_plugins
from engine.core.plugins_report import report
from engine.core.registry import SelectionContext, SelectionError
from engine.core.startup import select_graphs

GiB = 2**30
MI355X = PlatformSpec("amd", "gfx950", "AMD Instinct MI355X", "cuda", 288 * GiB, 287 * GiB, 256,
                      frozenset({"fp8", "mxfp8"}))
H200 = PlatformSpec("nvidia", "sm_90", "NVIDIA H200", "cuda", 141 * GiB, 140 * GiB, 132, frozenset({"fp8", "wgmma"}))


@pytest.fixture
def rocm_torch(monkeypatch):
    """torch as its ROCm build answers on an MI355X; hip-python absent. Returns a setter of the
    ROCm release torch reports."""
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    props = SimpleNamespace(name=MI355X.device_name, gcnArchName="gfx950:sramecc+:xnack-", multi_processor_count=256)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (MI355X.free_memory, MI355X.total_memory))
    monkeypatch.setitem(sys.modules, "hip", None)

    def release(hip: str | None) -> None:
        monkeypatch.setattr(torch.version, "hip", hip)

    release("6.4.43482-0f2d60242")
    return release


def test_a_rocm_host_selects_hip_graphs(rocm_torch):
    """`engine plugins` and start-up pick HIP graphs on the ROCm platform; CUDA graphs say why not."""
    plugins = load_plugins()
    ctx = SelectionContext(platform=plugins.detect_platform(), engine_config=EngineConfig(model="m"))
    assert ctx.platform == MI355X
    text = report(plugins, ctx)
    assert "graphs: selects hip_graphs (plugin rocm)" in text
    assert f"needs an NVIDIA GPU (the platform is {MI355X.summary()})" in text
    assert select_graphs(plugins, ctx, EngineConfig(model="m")).chosen.name == "hip_graphs"
    assert select_graphs(plugins, ctx, EngineConfig(model="m", enforce_eager=True)) is None


def hip_graphs_reasons(plugins, ctx) -> list[str]:
    (descriptor,) = [d for d in plugins.descriptors("graphs") if d.name == "hip_graphs"]
    return descriptor.check(ctx)


@pytest.mark.parametrize("hip, reason", [
    ("5.3.22061-e8e78f1a", None),
    ("5.2.21151-afdc89f8",
     "torch's HIP graphs need ROCm 5.3 or later (this torch is built for ROCm 5.2.21151-afdc89f8)"),
    (None, f"needs a ROCm build of torch for HIP graphs (this is torch {torch.__version__})"),
])
def test_hip_graphs_refuse_a_torch_without_them(rocm_torch, hip, reason):
    """Refused, they leave steps eager unless named; named, they are refused with the reason."""
    rocm_torch(hip)
    plugins, config = load_plugins(), EngineConfig(model="m")
    ctx = SelectionContext(platform=MI355X, engine_config=config)
    assert hip_graphs_reasons(plugins, ctx) == ([] if reason is None else [reason])
    if reason is None:
        return
    assert select_graphs(plugins, ctx, config) is None
    with pytest.raises(SelectionError, match="graphs backend 'hip_graphs' cannot run here") as err:
        select_graphs(plugins, ctx, EngineConfig(model="m", graph_backend="hip_graphs"))
    assert reason in str(err.value)


def test_hip_graphs_refuse_an_nvidia_platform(rocm_torch):
    ctx = SelectionContext(platform=H200, engine_config=EngineConfig(model="m"))
    assert hip_graphs_reasons(load_plugins(), ctx) == [f"needs an AMD GPU (the platform is {H200.summary()})"]


def test_the_runners_take_hip_graphs_as_they_take_cuda_graphs():
    """CudaGraphs' capture, segments and pool under another name: decode buckets
    (core/graph_runner.py) and breakable prefill (core/prefill_graphs.py, which refuses a backend
    that records no segments) run on it; no method is its own."""
    assert issubclass(HipGraphs, CudaGraphs) and HipGraphs.breakable
    assert HipGraphs.name == "hip_graphs" and CudaGraphs.name == "cuda_graphs"
    assert {k for k, v in vars(HipGraphs).items() if callable(v)} == set()


def test_rocm_version():
    assert rocm_version("6.4.43482-0f2d60242") == (6, 4) and rocm_version("5.7") == (5, 7)


def test_programmatic_dependent_launch_stays_off(rocm_torch):
    from engine.backends.triton import pdl

    assert not pdl.supported(torch.device("cuda", 0))
