"""Deterministic chunk contents shared by the tests and their peer process."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from fabric.transfer import TransferNode, TransferServer

FINGERPRINT = "test-fingerprint-0001"


def chunk_bytes(seed: int, index: int, nbytes: int) -> bytes:
    """Pseudo-random bytes for chunk ``index`` of a request seeded ``seed``."""
    return np.random.default_rng([seed, index]).bytes(nbytes)


def chunk_key(seed: int, index: int) -> bytes:
    return seed.to_bytes(8, "little") + index.to_bytes(8, "little")


def fill_store(
    node: TransferNode, seed: int, n: int, slot_bytes: int
) -> tuple[list[bytes], list[int]]:
    """Commit ``n`` pattern chunks of ``slot_bytes`` into ``node``'s store: (keys, slots)."""
    keys, slots = [], []
    for i in range(n):
        key = chunk_key(seed, i)
        slot = node.store.allocate(key)
        node.store.pool.slot_view(slot).numpy()[:] = memoryview(chunk_bytes(seed, i, slot_bytes))
        node.store.commit(slot, key, slot_bytes)
        keys.append(key)
        slots.append(slot)
    return keys, slots


def loop_wakeups(server: TransferServer, seconds: float = 1.0) -> int:
    """How many times ``server``'s loop stepped in ``seconds`` (counted, not timed)."""
    steps = 0
    real = server._step

    def counted(*args: object) -> float:
        nonlocal steps
        steps += 1
        return real(*args)  # type: ignore[arg-type]

    server._step = counted  # type: ignore[method-assign]
    try:
        time.sleep(seconds)
    finally:
        server._step = real  # type: ignore[method-assign]
    return steps
