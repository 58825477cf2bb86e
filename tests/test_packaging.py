"""The ``kv-fabric`` distribution builds quietly and holds the ``fabric`` package and command."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any, ClassVar

import pytest
import torch
from setuptools import Distribution, Extension
from setuptools.command.build_ext import build_ext

from fabric.kv import cuda as kv_cuda

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


def _setup_module() -> ModuleType:
    """setup.py as a module (its ``setup()`` runs only as ``__main__``)."""
    spec = importlib.util.spec_from_file_location("fabric_setup", ROOT / "setup.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_cuda_kernels_are_built_ahead_only_with_cuda_torch_and_a_toolkit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    setup_py = _setup_module()
    assert setup_py.CUDA_SOURCES == kv_cuda.SOURCES, "the AOT and JIT builds compile the same"
    if torch.version.cuda is None:
        assert setup_py.cuda_extensions() == ([], {})  # this CPU torch: JIT (never, here)
    made: list[dict[str, Any]] = []
    fake = ModuleType("torch.utils.cpp_extension")
    fake.CUDA_HOME = "/usr/local/cuda"  # type: ignore[attr-defined]
    fake.BuildExtension = CudaBuild  # type: ignore[attr-defined]
    fake.CUDAExtension = lambda name, **kw: made.append({"name": name, **kw}) or name  # type: ignore[attr-defined]
    fake_torch = ModuleType("torch")
    fake_torch.version = SimpleNamespace(cuda="12.8")  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    monkeypatch.setitem(sys.modules, "torch.utils.cpp_extension", fake)
    extensions, cmdclass = setup_py.cuda_extensions()
    assert extensions == ["fabric.kv._cuda_pack"] and issubclass(cmdclass["build_ext"], CudaBuild)
    (ext,) = made
    assert ext["sources"] == [f"fabric/kv/csrc/{name}" for name in kv_cuda.SOURCES]
    assert ext["optional"] and ext["extra_compile_args"]["nvcc"] == list(kv_cuda.CUDA_FLAGS)
    assert Path(ext["include_dirs"][0], "fold64.h").is_file()
    fake.CUDA_HOME = None  # type: ignore[attr-defined]
    assert setup_py.cuda_extensions() == ([], {}), "no toolkit: JIT on first use"
    fake.CUDA_HOME = "/usr/local/cuda"  # type: ignore[attr-defined]
    monkeypatch.setenv("FABRIC_CUDA_AOT", "0")
    assert setup_py.cuda_extensions() == ([], {})


class CudaBuild(build_ext):
    """Stands in for torch's BuildExtension: records what it was asked to
    build, and fails like an nvcc error when ``fail``."""

    seen: ClassVar[list[list[str]]] = []
    fail = False

    def build_extensions(self) -> None:
        CudaBuild.seen.append([e.name for e in self.extensions])
        if CudaBuild.fail:
            raise RuntimeError("Error compiling objects for extension")


@pytest.mark.parametrize("fail", [False, True])
def test_only_the_cuda_extension_goes_through_torchs_builder_and_may_fail(
    tmp_path: Path, fail: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch's BuildExtension compiles every extension it is given as C++ (the
    C copy kernel would not build), and raises RuntimeError, which setuptools'
    optional extensions do not forgive: so the split."""
    setup_py = _setup_module()
    monkeypatch.setattr(CudaBuild, "seen", [])
    monkeypatch.setattr(CudaBuild, "fail", fail)
    monkeypatch.chdir(ROOT)
    copy = Extension("fabric.kv._copy", sources=["fabric/kv/_copy.c"], extra_link_args=["-pthread"])
    cuda = Extension("fabric.kv._cuda_pack", sources=["fabric/kv/csrc/pack_kernels.cu"])
    dist = Distribution({"ext_modules": [copy, cuda]})
    dist.cmdclass["build_ext"] = setup_py.split_build_ext(CudaBuild)
    command = dist.get_command_obj("build_ext")
    command.build_lib, command.build_temp = str(tmp_path / "lib"), str(tmp_path / "tmp")
    dist.run_command("build_ext")
    assert CudaBuild.seen == [["fabric.kv._cuda_pack"]]
    assert list((tmp_path / "lib" / "fabric" / "kv").glob("_copy*.so"))
    assert [e.name for e in command.extensions] == (
        ["fabric.kv._copy"] if fail else ["fabric.kv._copy", "fabric.kv._cuda_pack"]
    )
