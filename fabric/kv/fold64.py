"""fold64: the checksum of chunks that live in device memory.

xxh3 (:mod:`fabric.store.checksum`) hashes a chunk in one sequential pass on
the host. A chunk in VRAM would need a device-to-host copy for that, so pools
on a GPU hash with fold64 instead, a sum that a GPU computes in one parallel
pass (``fabric/kv/csrc/fold64.h`` defines it; this module is the same
definition in torch, on any device)::

    word(i) = bytes [8i, 8i + 8) as a little-endian uint64 (the tail zero-padded)
    term(i) = mix(word(i) ^ (i * POS))            mix: splitmix64's finalizer
    fold64  = mix(sum_i term(i) ^ mix(nbytes + POS))   (all mod 2**64)

``mix`` is a bijection, so changing any one word always changes the checksum;
the index term makes a moved or swapped word count. Like xxh3 it guards
against faults (a stale, torn or misplaced chunk), not against an adversary.

:func:`fold64` runs the fused kernel (:func:`fabric.kv.cuda.load_extension`)
for a CUDA tensor when it loads, else these torch ops on the tensor's device
(bit-identical; ``tests/kv/test_fold64.py`` checks the header against them).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["POS", "fold64", "fold64_reference", "fold64_tensor"]

_MASK = (1 << 64) - 1
POS = 0x9E3779B97F4A7C15
MUL1 = 0xBF58476D1CE4E5B9
MUL2 = 0x94D049BB133111EB


def _signed(value: int) -> int:
    """``value`` mod 2**64 as the int64 torch stores."""
    value &= _MASK
    return value - (1 << 64) if value >= 1 << 63 else value


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 ``x`` (torch's ``>>`` is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = (x ^ _shr(x, 30)) * _signed(MUL1)
    x = (x ^ _shr(x, 27)) * _signed(MUL2)
    return x ^ _shr(x, 31)


def _mix_int(x: int) -> int:
    x = ((x ^ (x >> 30)) * MUL1) & _MASK
    x = ((x ^ (x >> 27)) * MUL2) & _MASK
    return x ^ (x >> 31)


def fold64_tensor(data: torch.Tensor) -> torch.Tensor:
    """fold64 of a contiguous uint8 tensor's bytes as an int64 scalar tensor on its device.

    Device-side throughout (no host copy, no sync): the caller reads it with
    ``.item()`` when it needs the number.
    """
    import torch

    flat = data.reshape(-1)
    if flat.dtype != torch.uint8:
        raise ValueError(f"fold64 hashes uint8 bytes, got {flat.dtype}")
    nbytes = flat.numel()
    if nbytes % 8 or flat.data_ptr() % 8:
        # NOTE: a whole number of aligned words (view(int64) needs both)
        padded = flat.new_zeros(nbytes + -nbytes % 8)
        padded[:nbytes] = flat
        flat = padded
    # NOTE: view(int64) reads native byte order; every machine fabric runs on
    # (x86-64, aarch64, NVIDIA GPUs) is little-endian, as the definition wants.
    words = flat.view(torch.int64)
    index = torch.arange(words.numel(), dtype=torch.int64, device=flat.device)
    total = _mix(words ^ (index * _signed(POS))).sum(dtype=torch.int64)
    length = torch.tensor(_signed(_mix_int((nbytes + POS) & _MASK)), device=flat.device)
    return _mix(total ^ length)


def fold64(data: torch.Tensor) -> int:
    """fold64 of ``data``'s bytes (a contiguous uint8 tensor) as an unsigned int.

    On a CUDA tensor it runs (the fused kernel when the extension loads, else
    torch ops) on a stream this thread keeps for it, ordered after nothing:
    the bytes must be complete when it is called (landed by NIXL, or a copy
    into them synchronized: :func:`fabric.kv.pack.settle`). So a verifier
    thread does not wait for work queued on the engine's stream (torch hands
    streams out from a shared pool, so it may share one with other fabric
    work, never with the legacy default stream); ``.item()`` waits for the
    hash and whatever shares its stream.
    """
    if data.device.type != "cuda":
        return int(fold64_tensor(data).item()) & _MASK
    import torch

    from fabric.kv.cuda import load_extension

    extension = load_extension()
    stream = _own_stream(data.device)
    with torch.cuda.stream(stream):  # NOTE: its __enter__ returns None, not the stream
        if extension is not None and hasattr(extension, "fold64"):
            out = data.new_empty(1, dtype=torch.int64)
            extension.fold64(data.reshape(-1), out, stream.cuda_stream)
            return int(out.item()) & _MASK
        return int(fold64_tensor(data).item()) & _MASK


_streams = threading.local()


def _own_stream(device: torch.device) -> torch.cuda.Stream:
    """This thread's stream on ``device`` (created once)."""
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    mine: dict[int, torch.cuda.Stream] = _streams.__dict__.setdefault("by_device", {})
    if index not in mine:
        mine[index] = torch.cuda.Stream(device=index)
    return mine[index]


def fold64_reference(data: bytes) -> int:
    """fold64 in plain Python, word by word: the slow, obvious definition (tests)."""
    padded = data + bytes(-len(data) % 8)
    total = 0
    for i in range(len(padded) // 8):
        word = int.from_bytes(padded[8 * i : 8 * i + 8], "little")
        total = (total + _mix_int(word ^ ((i * POS) & _MASK))) & _MASK
    return _mix_int(total ^ _mix_int((len(data) + POS) & _MASK))
