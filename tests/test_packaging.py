"""The wheel maps the repository root to ``engine`` and registers the built-in plugins."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_has_only_the_engine_package(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path), str(ROOT)],
                   check=True, capture_output=True, timeout=300)
    wheel = zipfile.ZipFile(next(tmp_path.glob("engine-*.whl")))
    names = wheel.namelist()
    assert {n.split("/")[0] for n in names if not n.startswith("engine-")} == {"engine"}
    packaged = {str(Path(n).parent) for n in names if n.endswith("__init__.py")}
    on_disk = {"engine" + ("/" + str(p.parent.relative_to(ROOT)) if p.parent != ROOT else "")
               for p in ROOT.rglob("__init__.py")
               if not p.relative_to(ROOT).parts[0].startswith((".", "tests", "build"))}
    assert packaged == on_disk  # every package of the tree is in the wheel (pyproject lists them)
    entry_points = next(wheel.read(n).decode() for n in names if n.endswith("entry_points.txt"))
    for line in ("native = engine.core.native.plugin", "cuda = engine.backends.cuda.plugin",
                 "rocm = engine.backends.rocm.plugin", "nixl = engine.plugins.nixl",
                 "mooncake = engine.plugins.mooncake", "engine = engine.server.cli:main"):
        assert line in entry_points
