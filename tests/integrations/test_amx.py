"""AMX tiles: vLLM's CPU attention uses them, so every model process must ask Linux first.

On a CPU with AMX (Sapphire Rapids and later) a bfloat16 engine whose
worker never asked dies of SIGILL at its first attention step; this was
every e2e engine on such a machine before fabric's engine entry point and
connector asked. Skipped where the CPU has no AMX.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fabric.integrations.vllm.amx import cpu_has_amx

ROOT = Path(__file__).parents[2]
ATTENTION = Path(__file__).with_name("amx_attention.py")


pytestmark = pytest.mark.skipif(not cpu_has_amx(), reason="this CPU has no AMX tiles")


def _python(*code_or_args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *code_or_args], capture_output=True, text=True, cwd=ROOT, timeout=300
    )


def test_a_fresh_process_may_not_use_tiles_until_it_asks() -> None:
    code = (
        "from fabric.integrations.vllm.amx import amx_tiles_permitted, request_amx_tiles\n"
        "before = amx_tiles_permitted()\n"
        "granted = request_amx_tiles()\n"
        "print(before, granted, amx_tiles_permitted())\n"
    )
    done = _python("-c", code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "True", "True"]


def test_the_engine_entry_point_asks_at_import() -> None:
    """Spawned children import ``fabric.launch.vllm_main`` as ``__mp_main__``:
    the import, not ``main()``, is what must ask."""
    code = (
        "import fabric.launch.vllm_main\n"
        "from fabric.integrations.vllm.amx import amx_tiles_permitted\n"
        "print(amx_tiles_permitted())\n"
    )
    done = _python("-c", code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True"]


def test_vllm_cpu_attention_dies_without_asking_and_runs_after() -> None:
    pytest.importorskip("vllm")
    without = _python(str(ATTENTION), "no")
    assert "isa amx" in without.stdout, (without.stdout, without.stderr[-2000:])
    assert without.returncode == -signal.SIGILL, (without.returncode, without.stderr[-2000:])
    asked = _python(str(ATTENTION), "ask")
    assert asked.returncode == 0, asked.stderr[-2000:]
    assert "ok" in asked.stdout, asked.stdout
