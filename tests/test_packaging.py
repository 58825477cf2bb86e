"""The ``kv-fabric`` distribution builds quietly and holds the ``fabric`` package and command."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).parents[1]


COPY_IGNORES = (".git", ".venv", "build", "*.egg-info", "__pycache__", "*.so", ".*_cache")


def test_the_wheel_holds_the_package_the_command_and_the_copy_kernel(tmp_path: Path) -> None:
    # NOTE: from a copy: a build in the tree leaves build/ behind (and stale
    # modules there would reach a later wheel)
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*COPY_IGNORES))
    built = subprocess.run(
        [
            *(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"),
            *("--wheel-dir", str(tmp_path), str(source)),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    # NOTE: setuptools' "experimental" ext-modules table warned at every build
    assert "Warning" not in built.stdout + built.stderr, built.stdout + built.stderr
    (wheel,) = tmp_path.glob("kv_fabric-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        assert "fabric = fabric.cli:main" in archive.read(entry_points).decode()
    assert "fabric/cli.py" in names and "fabric/py.typed" in names
    assert "fabric/kv/_copy.c" in names  # NOTE: pack can rebuild it where the wheel cannot load
    # NOTE: the CUDA kernels' sources, for fabric.kv.cuda's JIT build on a GPU machine
    csrc = {"pack_binding.cpp", "pack_kernels.cu", "pack_kernels.h", "checksum_kernels.cu"}
    csrc |= {"checksum_kernels.h", "fold64.h"}
    assert {f"fabric/kv/csrc/{name}" for name in csrc} <= set(names), names
    assert any(n.startswith("fabric/kv/_copy.") and n.endswith(".so") for n in names), names
    assert not any(n.startswith(("tests/", "benchmarks/", "scripts/")) for n in names)
