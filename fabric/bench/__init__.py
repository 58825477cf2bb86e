"""Benchmark implementations shared by ``benchmarks/*.py`` and ``fabric bench``."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TypeVar

from fabric.errors import ConfigError

T = TypeVar("T")


def parse_config(
    parser: argparse.ArgumentParser,
    argv: list[str] | None,
    config_from_args: Callable[[argparse.Namespace], T],
) -> tuple[argparse.Namespace, T]:
    """The options and the config they make; a ``ConfigError`` exits as
    argparse's own errors do (usage, the message, status 2)."""
    ns = parser.parse_args(argv)
    try:
        return ns, config_from_args(ns)
    except ConfigError as exc:
        parser.error(str(exc))
