"""Threads that carry their names to the OS.

Python names a thread for itself only: ``top -H``, ``ps -L`` and
``/proc/<pid>/task/<tid>/comm`` show every fabric thread inside a vLLM
engine as the thread that started it (``VLLM::Worker``, ``python``). A
thread made here names itself for the OS (``prctl(PR_SET_NAME)``, Linux;
the first 15 bytes) before it runs its target, so an operator -- or a
benchmark looking for busy pollers -- can tell ``fabric-load`` from
``fabric-push`` from vLLM's own threads.
"""

from __future__ import annotations

import ctypes
import sys
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["os_name", "set_os_name", "start_named", "thread"]

PR_SET_NAME = 15
OS_NAME_BYTES = 15  # the kernel keeps 16 bytes, the last one a NUL

_libc: Any = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(None, use_errno=True)
    except OSError:  # pragma: no cover - a libc that cannot be loaded
        _libc = None


def set_os_name(name: str) -> bool:
    """Name the calling thread ``name`` for the OS (its first 15 bytes);
    whether it could. Never raises: a name is for the operator, and a thread
    (or a pool whose initializer this is) must run without one."""
    if _libc is None:
        return False
    try:
        raw = name.encode("ascii", "replace")[:OS_NAME_BYTES]
        return int(_libc.prctl(PR_SET_NAME, ctypes.c_char_p(raw), 0, 0, 0)) == 0
    except Exception:  # NOTE: a libc without prctl, a ctypes error
        return False


def os_name(tid: int | None = None) -> str | None:
    """The OS name of thread ``tid`` of this process (default: the calling one)."""
    tid = threading.get_native_id() if tid is None else tid
    try:
        with open(f"/proc/self/task/{tid}/comm", encoding="utf-8", errors="replace") as comm:
            return comm.read().strip()
    except OSError:
        return None


def thread(
    target: Callable[..., object],
    *,
    name: str,
    args: tuple[Any, ...] = (),
    daemon: bool = True,
    os_name: str | None = None,
) -> threading.Thread:
    """A thread (not started) named ``name`` that names itself ``os_name``
    (default ``name``; the OS keeps 15 bytes: give a short one that still
    tells threads apart) for the OS, then runs ``target``."""

    def run(*call_args: Any) -> None:
        set_os_name(os_name or name)
        target(*call_args)

    return threading.Thread(target=run, args=args, name=name, daemon=daemon)


def start_named(target: Callable[..., object], *, name: str, args: tuple[Any, ...] = ()) -> None:
    """Start a daemon :func:`thread`."""
    thread(target, name=name, args=args).start()
