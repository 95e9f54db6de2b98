"""Plugin loading, platform detection and selection across real entry points.

The third-party side is the ``engine-dummy-plugin`` distribution in tests/plugins/dummy, installed
beside the engine (``pip install ./tests/plugins/dummy``). Platform plugins are exercised on this
CPU host by faking what torch and the vendor libraries report.
"""

from __future__ import annotations

import importlib.metadata
import logging
import sys
import types
from types import SimpleNamespace

import pluggy
import pytest
import torch

from engine.backends.cuda import platform as cuda_platform
from engine.backends.rocm import platform as rocm_platform
from engine.core import hookspecs
from engine.core.families.attention import AttentionBackend
from engine.core.hookspecs import hookimpl
from engine.core.platform import PlatformSpec
from engine.core.plugins import CPU_PLATFORM, ENTRY_POINT_GROUP, load_plugins
from engine.core.plugins_report import report
from engine.core.registry import SelectionContext, SelectionError

BUILT_IN = {"native": "engine.core.native.plugin", "cuda": "engine.backends.cuda.plugin",
            "rocm": "engine.backends.rocm.plugin"}
DUMMY_REASON = "dummy-fast is disabled: set ENGINE_DUMMY_ENABLE=1 to enable it"
DUMMY_REFUSAL = "dummy-refuses never serves: it exists to test refusals"
GiB = 2**30


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for var in ("ENGINE_PLUGINS", "ENGINE_DUMMY_ENABLE", "ENGINE_TRACE_PLUGINS"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def dummy():
    try:
        importlib.metadata.distribution("engine-dummy-plugin")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("engine-dummy-plugin is not installed: pip install ./tests/plugins/dummy")


def plugin(name: str, **hooks) -> types.ModuleType:
    """A plugin module as a third party would write it: functions marked with ``hookimpl``."""
    module = types.ModuleType(name)
    for hook, fn in hooks.items():
        fn.__name__ = hook
        setattr(module, hook, hookimpl(fn))
    return module


def claims(spec):
    return plugin(f"claims_{spec.arch}", engine_detect_platform=lambda: spec)


H200 = PlatformSpec("nvidia", "sm_90", "NVIDIA H200", "cuda", 141 * GiB, 140 * GiB, 132, frozenset({"fp8", "wgmma"}))
MI300X = PlatformSpec("amd", "gfx942", "AMD Instinct MI300X", "cuda", 192 * GiB, 191 * GiB, 304, frozenset({"fp8"}))


# discovery and the allowlist

def test_discovery_lists_builtin_and_third_party_plugins(dummy):
    plugins = load_plugins()
    found = {p.name: p for p in plugins.discovered}
    assert set(BUILT_IN) | {"dummy"} <= set(found)
    for name, module in BUILT_IN.items():
        assert (found[name].module, found[name].distribution, found[name].loaded) == (module, "engine", True)
    assert (found["dummy"].module, found["dummy"].distribution, found["dummy"].loaded) == \
        ("engine_dummy_plugin", "engine-dummy-plugin", True)
    assert all(plugins.pm.has_plugin(name) for name in found)


def test_allowlist_limits_loading(dummy, monkeypatch):
    monkeypatch.setenv("ENGINE_PLUGINS", "native, dummy")
    plugins = load_plugins()
    status = {p.name: (p.loaded, p.error) for p in plugins.discovered}
    assert status["native"] == status["dummy"] == (True, "")
    assert status["cuda"] == status["rocm"] == (False, "not in ENGINE_PLUGINS")
    assert not plugins.pm.has_plugin("cuda") and not plugins.pm.has_plugin("rocm")
    assert {d.name for d in plugins.descriptors("attention")} == {"native", "dummy-fast", "dummy-refuses"}

    monkeypatch.setenv("ENGINE_PLUGINS", "native")
    plugins = load_plugins()
    assert [p.name for p in plugins.discovered if p.loaded] == ["native"]
    assert {d.name for d in plugins.descriptors("attention")} == {"native"}
    assert "DummyForCausalLM" not in {d.name for d in plugins.descriptors("model")}


def test_allowlist_warns_about_names_that_are_not_installed(monkeypatch, caplog):
    monkeypatch.setenv("ENGINE_PLUGINS", "native,natvie")
    with caplog.at_level(logging.WARNING, logger="engine.core.plugins"):
        plugins = load_plugins()
    assert "not installed: natvie" in caplog.text
    assert [p.name for p in plugins.discovered if p.loaded] == ["native"]


def test_a_plugin_whose_import_raises_is_logged_and_skipped(monkeypatch, tmp_path, caplog):
    (tmp_path / "engine_broken_plugin.py").write_text("raise RuntimeError('cannot start without its library')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    real = importlib.metadata.entry_points
    broken = importlib.metadata.EntryPoint("broken", "engine_broken_plugin", ENTRY_POINT_GROUP)
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **kw: [*real(**kw), broken])

    with caplog.at_level(logging.WARNING, logger="engine.core.plugins"):
        plugins = load_plugins()

    info = {p.name: p for p in plugins.discovered}["broken"]
    assert not info.loaded and info.error == "RuntimeError: cannot start without its library"
    assert "plugin broken (engine_broken_plugin) failed to load" in caplog.text
    assert not plugins.pm.has_plugin("broken")
    assert plugins.pm.has_plugin("native") and plugins.select("attention", SelectionContext(CPU_PLATFORM))


def test_a_misspelled_hook_fails_loading():
    typo = plugin("typo", engine_detect_platfrom=lambda: None)
    with pytest.raises(pluggy.PluginValidationError, match="engine_detect_platfrom"):
        load_plugins(extra=[typo], entry_points=False)


def test_a_descriptor_from_the_wrong_hook_is_refused():
    from engine.core.registry import Descriptor

    wrong = plugin("wrong", engine_register_moe_backends=lambda: [Descriptor("attention", "x", lambda ctx: None)])
    plugins = load_plugins(extra=[wrong], entry_points=False)
    with pytest.raises(SelectionError, match="plugin wrong returned a 'attention' descriptor from the moe hook"):
        plugins.descriptors("moe")


# platform detection

HAS_GPU = torch.cuda.is_available()
cpu_host_only = pytest.mark.skipif(HAS_GPU, reason="this host has a GPU, which its plugin claims")


def test_no_claim_means_cpu():
    assert load_plugins(entry_points=False).detect_platform() == CPU_PLATFORM


@cpu_host_only
def test_platform_plugins_decline_on_a_cpu_host():
    assert cuda_platform.detect() is None and rocm_platform.detect() is None
    assert load_plugins().detect_platform() == CPU_PLATFORM


@pytest.mark.gpu
def test_the_gpu_of_this_host_is_detected_as_torch_sees_it():
    spec = load_plugins().detect_platform()
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    if torch.version.hip:
        assert (spec.vendor, spec.arch) == ("amd", props.gcnArchName.split(":")[0])
    else:
        assert (spec.vendor, spec.arch) == ("nvidia", f"sm_{props.major}{props.minor}")
        assert spec.capabilities == cuda_platform.capabilities(props.major, props.minor)
    assert (spec.device_name, spec.compute_units, spec.torch_device) == (props.name, props.multi_processor_count, "cuda")
    assert abs(spec.total_memory - props.total_memory) <= 0.01 * props.total_memory
    assert 0 < spec.free_memory <= spec.total_memory


def test_one_gpu_claim_wins_over_cpu_and_failing_detectors(caplog):
    def fails():
        raise OSError("driver not loaded")

    extra = [claims(CPU_PLATFORM), claims(H200), plugin("flaky", engine_detect_platform=fails)]
    with caplog.at_level(logging.WARNING, logger="engine.core.plugins"):
        assert load_plugins(extra=extra, entry_points=False).detect_platform() == H200
    assert "platform detection in plugin flaky failed: driver not loaded" in caplog.text


def test_an_engine_told_to_run_on_the_cpu_gets_the_cpu_platform_beside_a_gpu_claim():
    """On a GPU machine an engine on device "cpu" (an oracle beside a GPU engine) must select no GPU
    kernel: its tensors live on the host."""
    plugins = load_plugins(extra=[claims(H200), claims(MI300X)], entry_points=False)
    assert plugins.detect_platform("cpu") == CPU_PLATFORM
    assert load_plugins(extra=[claims(H200)], entry_points=False).detect_platform("cuda:0") == H200


def test_two_gpu_claims_are_an_error():
    plugins = load_plugins(extra=[claims(H200), claims(MI300X)], entry_points=False)
    with pytest.raises(SelectionError, match="more than one plugin claims this machine") as err:
        plugins.detect_platform()
    assert "claims_sm_90 (nvidia sm_90" in str(err.value) and "claims_gfx942 (amd gfx942" in str(err.value)


@pytest.mark.parametrize("major, minor, arch, caps", [
    (8, 0, "sm_80", set()),
    (8, 9, "sm_89", {"fp8"}),
    (9, 0, "sm_90", {"fp8", "wgmma"}),
    (10, 0, "sm_100", {"fp8", "mxfp8", "tcgen05"}),
    (10, 3, "sm_103", {"fp8", "mxfp8", "tcgen05"}),
    (12, 0, "sm_120", {"fp8", "mxfp8"}),
])
def test_cuda_arch_and_capabilities(major, minor, arch, caps):
    assert cuda_platform.arch_name(major, minor) == arch
    assert cuda_platform.capabilities(major, minor) == caps


@pytest.mark.parametrize("gcn, arch, caps", [
    ("gfx942:sramecc+:xnack-", "gfx942", {"fp8"}),
    ("gfx950:sramecc+:xnack-", "gfx950", {"fp8", "mxfp8"}),
    ("gfx90a", "gfx90a", set()),
])
def test_rocm_arch_and_capabilities(gcn, arch, caps):
    assert rocm_platform.arch_name(gcn) == arch
    assert rocm_platform.capabilities(arch) == caps


def fake_torch_gpu(monkeypatch, *, cuda=None, hip=None, props=None, mem=(0, 0)):
    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: mem)


def block_module(monkeypatch, name):
    """`import name` (and of any submodule, even one imported before) now raises ImportError."""
    for loaded in [m for m in sys.modules if m == name or m.startswith(name + ".")] + [name]:
        monkeypatch.setitem(sys.modules, loaded, None)


def fake_cuda_runtime(monkeypatch, *, fail=False):
    """A stand-in for cuda-python's ``cuda.bindings.runtime`` answering like a B200 on device 0."""
    err = SimpleNamespace(cudaSuccess=0)
    rt = types.ModuleType("cuda.bindings.runtime")
    rt.cudaError_t = err
    props = SimpleNamespace(name=b"NVIDIA B200\x00\x00", major=10, minor=0, multiProcessorCount=148,
                            totalGlobalMem=180 * GiB)
    rt.cudaSetDevice = lambda device: (0,)
    rt.cudaGetDeviceProperties = lambda device: (3, None) if fail else (0, props)
    rt.cudaMemGetInfo = lambda: (0, 170 * GiB, 179 * GiB)
    bindings = types.ModuleType("cuda.bindings")
    bindings.runtime = rt
    package = types.ModuleType("cuda")
    package.bindings = bindings
    package.__path__ = []
    bindings.__path__ = []
    for name, module in (("cuda", package), ("cuda.bindings", bindings), ("cuda.bindings.runtime", rt)):
        monkeypatch.setitem(sys.modules, name, module)


def test_cuda_detection_through_torch_when_cuda_python_is_absent(monkeypatch):
    block_module(monkeypatch, "cuda")
    props = SimpleNamespace(name="NVIDIA H200", major=9, minor=0, multi_processor_count=132)
    fake_torch_gpu(monkeypatch, cuda="12.8", props=props, mem=(140 * GiB, 141 * GiB))
    plugins = load_plugins()
    assert plugins.detect_platform() == H200  # the ROCm plugin declines: torch is no ROCm build


def test_cuda_detection_prefers_cuda_python(monkeypatch):
    fake_cuda_runtime(monkeypatch)
    fake_torch_gpu(monkeypatch, cuda="12.8", props=None)  # torch must not be asked
    spec = cuda_platform.detect()
    assert spec == PlatformSpec("nvidia", "sm_100", "NVIDIA B200", "cuda", 179 * GiB, 170 * GiB, 148,
                                frozenset({"fp8", "mxfp8", "tcgen05"}))


def test_cuda_python_failure_falls_back_to_torch(monkeypatch, caplog):
    fake_cuda_runtime(monkeypatch, fail=True)
    props = SimpleNamespace(name="NVIDIA H200", major=9, minor=0, multi_processor_count=132)
    fake_torch_gpu(monkeypatch, cuda="12.8", props=props, mem=(140 * GiB, 141 * GiB))
    with caplog.at_level(logging.WARNING, logger=cuda_platform.__name__):
        assert cuda_platform.detect() == H200
    assert "cuda-python device query failed" in caplog.text


def test_rocm_detection(monkeypatch):
    block_module(monkeypatch, "hip")
    props = SimpleNamespace(name="AMD Instinct MI300X", gcnArchName="gfx942:sramecc+:xnack-",
                            multi_processor_count=304)
    fake_torch_gpu(monkeypatch, hip="6.3.42131", props=props, mem=(191 * GiB, 192 * GiB))
    assert load_plugins().detect_platform() == MI300X
    assert cuda_platform.detect() is None

    hip = types.ModuleType("hip")
    hip.hip = SimpleNamespace(
        hipError_t=SimpleNamespace(hipSuccess=0),
        hipDeviceAttribute_t=SimpleNamespace(hipDeviceAttributeMultiprocessorCount="cu"),
        hipDeviceGetAttribute=lambda attr, device: (0, 256) if attr == "cu" else (1, None),
    )
    monkeypatch.setitem(sys.modules, "hip", hip)
    assert rocm_platform.detect().compute_units == 256
    hip.hip.hipDeviceGetAttribute = lambda attr, device: (7, None)  # hip-python cannot answer: torch does
    assert rocm_platform.detect() == MI300X


def test_both_vendor_builds_claiming_is_an_error(monkeypatch):
    block_module(monkeypatch, "cuda")
    block_module(monkeypatch, "hip")
    props = SimpleNamespace(name="?", major=9, minor=0, multi_processor_count=1, gcnArchName="gfx942")
    fake_torch_gpu(monkeypatch, cuda="12.8", hip="6.3", props=props, mem=(1, 2))
    with pytest.raises(SelectionError, match="more than one plugin claims this machine"):
        load_plugins().detect_platform()


# selection with the third-party plugin

def cpu_ctx() -> SelectionContext:
    return SelectionContext(platform=CPU_PLATFORM)


def test_enabled_dummy_wins_attention_over_every_other_candidate(dummy, monkeypatch):
    monkeypatch.setenv("ENGINE_DUMMY_ENABLE", "1")
    plugins = load_plugins()
    sel = plugins.select("attention", cpu_ctx())
    assert (sel.chosen.name, sel.chosen.plugin, sel.explicit) == ("dummy-fast", "dummy", False)
    others = [c for c in sel.candidates if c.descriptor.name != "dummy-fast"]
    assert others and all(c.priority < sel.candidates[0].priority or c.reasons for c in others)
    backend = sel.create(cpu_ctx())
    assert isinstance(backend, AttentionBackend) and backend.name == "dummy-fast"
    assert type(backend).__module__ == "engine_dummy_plugin.attention"


def test_disabled_dummy_reports_its_reason_and_another_backend_is_chosen(dummy):
    plugins = load_plugins()
    sel = plugins.select("attention", cpu_ctx())
    assert not sel.chosen.name.startswith("dummy")
    reasons = {c.descriptor.name: c.reasons for c in sel.candidates}
    assert reasons["dummy-fast"] == (DUMMY_REASON,)
    assert reasons["dummy-refuses"] == (DUMMY_REFUSAL,)
    assert reasons[sel.chosen.name] == ()


def test_when_only_the_dummy_offers_attention_the_error_carries_its_reason(dummy, monkeypatch):
    monkeypatch.setenv("ENGINE_PLUGINS", "dummy")
    with pytest.raises(SelectionError, match="no attention backend can run here") as err:
        load_plugins().select("attention", cpu_ctx())
    assert DUMMY_REASON in str(err.value) and DUMMY_REFUSAL in str(err.value)


def test_requesting_a_refusing_backend_names_every_candidate_with_its_reasons(dummy):
    plugins = load_plugins()
    with pytest.raises(SelectionError) as err:
        plugins.select("attention", cpu_ctx(), requested="dummy-refuses")
    msg = str(err.value)
    assert f"attention backend 'dummy-refuses' cannot run here: {DUMMY_REFUSAL}" in msg
    for d in plugins.descriptors("attention"):
        assert f"- {d.name} (plugin {d.plugin}, priority " in msg
    assert DUMMY_REASON in msg


def test_requesting_an_unknown_backend_lists_the_candidates(dummy):
    with pytest.raises(SelectionError, match="'flash' is not registered") as err:
        load_plugins().select("attention", cpu_ctx(), requested="flash")
    assert "- native (plugin native, priority 0): ok" in str(err.value)
    assert "- dummy-fast (plugin dummy" in str(err.value)


def test_third_party_model_architecture(dummy):
    plugins = load_plugins()
    sel = plugins.select("model", cpu_ctx(), requested="DummyForCausalLM")
    model_cls = sel.create(cpu_ctx())
    from engine.core.models.base import CausalLM

    assert isinstance(model_cls, type) and issubclass(model_cls, CausalLM)
    assert model_cls.__name__ == "DummyForCausalLM" and sel.chosen.plugin == "dummy"


@pytest.mark.parametrize("allow", ["cuda", "rocm", "native", None])
def test_every_plugin_selection_finds_the_built_in_architectures(monkeypatch, allow):
    """The catalogue is the core's, not a backend's: no allowlist (or no entry point at all) drops it."""
    from engine.core.models.catalogue import ARCHITECTURES
    from engine.core.registry import import_path
    from engine.core.startup import select_model_class

    if allow is not None:
        monkeypatch.setenv("ENGINE_PLUGINS", allow)
    plugins = load_plugins(entry_points=allow is not None)
    assert [p.name for p in plugins.discovered if p.loaded] == ([allow] if allow else [])
    for arch, path in ARCHITECTURES.items():
        assert select_model_class(plugins, cpu_ctx(), arch) is import_path(path)
    assert {"DeepseekV4ForCausalLM", "Qwen3ForCausalLM"} <= set(ARCHITECTURES)


# the report

def test_report_names_every_family_and_the_platform(dummy):
    plugins = load_plugins()
    text = report(plugins, SelectionContext(platform=H200), {"attention": "dummy-refuses"})
    assert "Platform: nvidia sm_90 (NVIDIA H200, 141.0 GiB, 132 compute units)" in text
    assert "capabilities: fp8, wgmma" in text
    for family in hookspecs.FAMILIES:
        assert any(line.startswith(f"{family}") for line in text.splitlines()), family
    for name, module in {**BUILT_IN, "dummy": "engine_dummy_plugin"}.items():
        assert any(name in line and module in line and "loaded" in line for line in text.splitlines())
    assert "attention (requested 'dummy-refuses'): nothing selected" in text
    assert DUMMY_REASON in text and DUMMY_REFUSAL in text
    assert "graphs: selects cuda_graphs (plugin cuda)" in text  # the platform is an H200
    assert "linear: selects triton (plugin cuda)" in text
    assert "norm: selects triton (plugin cuda)" in text
    assert "sampling: selects triton (plugin cuda)" in text
    assert ("spec: off (--speculative-config names a proposer as its method); registered: draft_model, dspark, mtp, "
            "ngram") in text
    assert "DummyForCausalLM" in text

    model_config = SimpleNamespace(architecture="DummyForCausalLM")
    text = report(plugins, SelectionContext(platform=CPU_PLATFORM, model_config=model_config))
    assert "model (requested 'DummyForCausalLM'): selects DummyForCausalLM (plugin dummy)" in text


def test_report_marks_the_selection_and_explains_unloaded_plugins(dummy, monkeypatch):
    monkeypatch.setenv("ENGINE_PLUGINS", "native,dummy")
    monkeypatch.setenv("ENGINE_DUMMY_ENABLE", "1")
    plugins = load_plugins(extra=[claims(H200)], entry_points=True)
    text = report(plugins, SelectionContext(platform=plugins.detect_platform()))
    lines = text.splitlines()
    assert "attention: selects dummy-fast (plugin dummy)" in lines
    (marked,) = [line for line in lines if line.strip().startswith("* dummy-fast")]
    assert "priority 1000000" in marked and marked.rstrip().endswith("ok")
    assert any(line.split()[:1] == ["cuda"] and "not loaded: not in ENGINE_PLUGINS" in line for line in lines)
    assert "registered directly: builtin-models, claims_sm_90" in text
    assert "Platform: nvidia sm_90" in text
