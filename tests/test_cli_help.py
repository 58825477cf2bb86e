"""Every ``fabric ... --help`` reads as plain text in an 80-column terminal."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

COMMANDS = [
    [],
    ["version"],
    ["bench"],
    ["bench", "transfer"],
    ["bench", "serve"],
    ["model"],
    ["up"],
    ["proxy"],
    ["store"],
    ["store", "serve"],
    ["k8s"],
    ["status"],
]
# NOTE: reStructuredText markup from a docstring: ``literal``, :role:`target`.
MARKUP = re.compile(r"``|:(class|mod|func|meth|data|attr|exc):`")


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "fabric")
def test_help_is_plain_text_within_80_columns(command: list[str]) -> None:
    env = os.environ | {"COLUMNS": "80"}
    out = subprocess.run(
        [sys.executable, "-m", "fabric.cli", *command, "--help"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=True,
    ).stdout
    assert out.startswith("usage: ")
    assert not MARKUP.search(out), out
    assert max(len(line) for line in out.splitlines()) <= 80, out
