"""The core and the platform plugins import, load and detect with every vendor library absent."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

import engine

ROOT = Path(engine.__file__).resolve().parent
VENDOR = ("triton", "cuda", "hip", "pynvml", "cupy")
PLUGIN_FILES = ("backends/cuda/plugin.py", "backends/cuda/platform.py",
                "backends/rocm/plugin.py", "backends/rocm/platform.py")

SCRIPT = textwrap.dedent("""
    import importlib, json, pkgutil, sys

    VENDOR = set(sys.argv[1].split(","))

    class VendorAbsent:
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in VENDOR:
                raise ImportError(f"{name} is absent on this test machine")
            return None

    assert not VENDOR & {m.partition(".")[0] for m in sys.modules}, "imported before the finder"
    sys.meta_path.insert(0, VendorAbsent())

    def fail(name):
        raise ImportError(f"cannot walk {name}")

    imported = []
    for root in ("engine.core", "engine.server"):
        package = importlib.import_module(root)
        imported.append(root)
        for info in pkgutil.walk_packages(package.__path__, root + ".", onerror=fail):
            importlib.import_module(info.name)
            imported.append(info.name)
    for name in ("engine.backends.cuda.plugin", "engine.backends.rocm.plugin"):
        importlib.import_module(name)
        imported.append(name)

    from engine.core.plugins import CPU_PLATFORM, load_plugins

    plugins = load_plugins()
    platform = plugins.detect_platform()
    print(json.dumps({
        "imported": imported,
        "loaded": [p.name for p in plugins.discovered if p.loaded],
        "cpu": platform == CPU_PLATFORM,
        "vendor_modules": sorted(m for m in sys.modules if m.partition(".")[0] in VENDOR),
    }))
""")


def test_core_and_platform_plugins_work_without_vendor_libraries(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("ENGINE_PLUGINS", "ENGINE_TRACE_PLUGINS")}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, ",".join(VENDOR)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])

    modules = {p.relative_to(ROOT).with_suffix("").as_posix().replace("/", ".")
               for p in (ROOT / "core").rglob("*.py") if "__pycache__" not in p.parts}
    expected = {"engine." + m.removesuffix(".__init__") for m in modules}
    assert expected <= set(result["imported"])
    assert {"engine.backends.cuda.plugin", "engine.backends.rocm.plugin"} <= set(result["imported"])
    assert {"native", "cuda", "rocm"} <= set(result["loaded"])
    if not torch.cuda.is_available():
        # On a GPU host torch's own CUDA start-up asks importlib whether triton exists, which the
        # finder answers with ImportError, so only a CPU host can check the detected platform.
        assert result["cpu"]
    assert result["vendor_modules"] == []


def module_level_imports(source: str) -> set[str]:
    """Top-level package names imported when the module is imported (not inside functions)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(child, ast.Import):
                found.update(a.name.partition(".")[0] for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                found.add(child.module.partition(".")[0])
            visit(child)

    visit(ast.parse(source))
    return found


def test_the_scan_sees_module_level_imports_only():
    source = textwrap.dedent("""
        import os, triton.language as tl
        try:
            from cuda.bindings import runtime
        except ImportError:
            pass
        class K:
            import hip
        def lazy():
            import cupy
    """)
    assert module_level_imports(source) == {"os", "triton", "cuda", "hip"}


def test_no_core_or_platform_plugin_file_imports_a_vendor_module_at_import_time():
    files = [p for p in (ROOT / "core").rglob("*.py") if "__pycache__" not in p.parts]
    files += [ROOT / f for f in PLUGIN_FILES]
    offenders = {str(p.relative_to(ROOT)): sorted(module_level_imports(p.read_text()) & set(VENDOR)) for p in files}
    assert {f: v for f, v in offenders.items() if v} == {}
