"""AMX tiles for vLLM's CPU attention: a process must ask Linux before it uses them."""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import sys

logger = logging.getLogger(__name__)

ARCH_GET_XCOMP_PERM = 0x1022
"""``arch_prctl`` code that reads the XSAVE features this process may use (``asm/prctl.h``)."""
ARCH_REQ_XCOMP_PERM = 0x1023
"""``arch_prctl`` code that asks for an XSAVE feature (``asm/prctl.h``)."""
XFEATURE_XTILEDATA = 18
"""The AMX tile data feature (``arch/x86/include/asm/fpu/types.h``)."""
SYS_ARCH_PRCTL_X86_64 = 158


def request_amx_tiles() -> bool:
    """Ask Linux for this process's permission to use AMX tiles; True if granted.

    vLLM's CPU attention picks its AMX kernels for bfloat16 wherever the CPU
    has AMX (``vllm/v1/attention/backends/cpu_attn.py``, ``_get_attn_isa``:
    ``"amx"`` when ``torch.cpu._is_amx_tile_supported()``), but Linux (5.16
    and later) grants tile data only to a process that asked for it with
    ``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`` and kills one
    that runs a tile instruction without it with SIGILL. vLLM 0.32 does not
    ask, and oneDNN asks only before its own AMX kernels, so a worker's first
    attention step dies ("Fatal Python error: Illegal instruction" in
    ``cpu_attention_with_kv_cache``; the engine answers 500 from then on).
    The permission belongs to the process and does not survive ``exec``:
    every process that runs the model asks (fabric's engine entry point in
    each spawned child, and the connector's worker side). Where there is no
    AMX, no Linux x86-64 or an older kernel, the call fails harmlessly.
    """
    answer = _arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
    if answer is None:
        return False
    if answer != 0 and cpu_has_amx():
        # NOTE: e.g. a thread's signal stack too small for the AMX state: the
        # first attention step will die of SIGILL, so say why beforehand.
        errno = ctypes.get_errno()
        logger.warning(
            "fabric: this CPU has AMX but Linux refused this process its tiles (%s); "
            "vLLM's bfloat16 CPU attention will die of SIGILL",
            os.strerror(errno),
        )
    return answer == 0


def amx_tiles_permitted() -> bool:
    """Whether this process may use AMX tile data now (``ARCH_GET_XCOMP_PERM``)."""
    mask = ctypes.c_uint64(0)
    answer = _arch_prctl(ARCH_GET_XCOMP_PERM, ctypes.byref(mask))
    return answer == 0 and bool(mask.value & (1 << XFEATURE_XTILEDATA))


def cpu_has_amx() -> bool:
    """Whether the CPU has AMX tiles (``amx_tile`` in ``/proc/cpuinfo``)."""
    try:
        with open("/proc/cpuinfo") as info:
            return any(" amx_tile" in line for line in info if line.startswith("flags"))
    except OSError:
        return False


def _arch_prctl(code: int, arg: object) -> int | None:
    """``arch_prctl(code, arg)``'s return value; None where there is no such call."""
    if not _x86_64_linux():
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.syscall(SYS_ARCH_PRCTL_X86_64, code, arg))
    except (OSError, AttributeError):
        return None


def _x86_64_linux() -> bool:
    """A 64-bit process on Linux x86-64 (the syscall number is 64-bit only)."""
    return (
        sys.platform == "linux"
        and platform.machine() == "x86_64"
        and ctypes.sizeof(ctypes.c_void_p) == 8
    )
