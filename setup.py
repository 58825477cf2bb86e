"""The compiled parts (the rest of the build is in pyproject.toml).

Here rather than in ``[tool.setuptools] ext-modules``, which setuptools
still calls experimental and warns about at every build. Both are optional:

- ``fabric.kv._copy``, the C copy kernel: without a compiler the install goes
  on, and ``fabric.kv.pack`` falls back to torch copies.
- ``fabric.kv._cuda_pack``, the fused CUDA kernels of ``fabric/kv/csrc/``:
  built ahead of time only where this build imports a CUDA torch and finds
  the CUDA toolkit (``pip install --no-build-isolation`` with them installed;
  ``FABRIC_CUDA_AOT=0`` skips it). Elsewhere ``fabric.kv.cuda`` compiles the
  shipped sources on first use on a GPU (JIT), and logs why when it cannot.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from setuptools import Extension, setup

CSRC = Path("fabric", "kv", "csrc")
CUDA_MODULE = "fabric.kv._cuda_pack"
CUDA_SOURCES = ("pack_binding.cpp", "pack_kernels.cu", "checksum_kernels.cu")  # = fabric.kv.cuda
CUDA_FLAGS = ["-O3", "--expt-relaxed-constexpr"]


def cuda_extensions() -> tuple[list[Any], dict[str, Any]]:
    """(extensions, cmdclass) for the fused kernels, or nothing where they cannot be built."""
    if os.environ.get("FABRIC_CUDA_AOT", "") == "0":
        return [], {}
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except ImportError:  # NOTE: an isolated build has no torch: JIT on first use
        return [], {}
    if torch.version.cuda is None or CUDA_HOME is None:
        return [], {}
    extension = CUDAExtension(
        CUDA_MODULE,
        sources=[str(CSRC / name) for name in CUDA_SOURCES],
        include_dirs=[str(Path(__file__).resolve().parent / CSRC)],
        extra_compile_args={"cxx": ["-O3"], "nvcc": CUDA_FLAGS},
        optional=True,
    )
    return [extension], {"build_ext": split_build_ext(BuildExtension)}


def split_build_ext(cuda_build_ext: type) -> type:
    """A ``build_ext`` that builds the plain extensions with setuptools' own and
    only the CUDA one with ``cuda_build_ext`` (torch's BuildExtension: it
    patches the compiler for every extension, and would compile _copy.c as
    C++), and whose CUDA build may fail (logged; compiled on first use then)."""
    from setuptools.command.build_ext import build_ext

    class SplitBuildExt(cuda_build_ext):  # type: ignore[misc, valid-type]
        def build_extensions(self) -> None:
            plain = [e for e in self.extensions if e.name != CUDA_MODULE]
            cuda = [e for e in self.extensions if e.name == CUDA_MODULE]
            self.extensions = plain
            build_ext.build_extensions(self)
            if not cuda:
                return
            self.extensions = cuda
            try:
                super().build_extensions()
            except Exception as exc:  # NOTE: nvcc, a CUDA version mismatch, ninja...
                print(
                    f"fabric: the CUDA kernels were not built ahead of time ({exc}); "
                    "fabric.kv.cuda compiles them on first use on a GPU",
                    file=sys.stderr,
                )
                self.extensions = plain
            else:
                self.extensions = plain + cuda

    return SplitBuildExt


if __name__ == "__main__":
    cuda, cmdclass = cuda_extensions()
    setup(
        ext_modules=[
            Extension(
                "fabric.kv._copy",
                sources=["fabric/kv/_copy.c"],
                extra_link_args=["-pthread"],
                optional=True,
            ),
            *cuda,
        ],
        cmdclass=cmdclass,
    )
