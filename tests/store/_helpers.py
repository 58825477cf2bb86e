"""Helpers shared by the chunk store tests: keys, payloads, a fake clock, writers."""

from __future__ import annotations

from collections.abc import Callable

from fabric.store import ChunkStore, checksum

SLOT_BYTES = 256

StoreFactory = Callable[..., ChunkStore]


class FakeClock:
    """A manual monotonic clock in seconds, injected as ``ChunkStore(clock=...)``."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance_ms(self, ms: float) -> None:
        self.now += ms / 1000


def key(i: int) -> bytes:
    """A 16-byte chunk key."""
    return i.to_bytes(16, "little")


def payload(i: int, nbytes: int = SLOT_BYTES) -> bytes:
    """Deterministic, key-specific chunk bytes."""
    return bytes((i * 31 + j) % 251 for j in range(nbytes))


def write(store: ChunkStore, slot: int, data: bytes) -> int:
    """Write ``data`` at the start of ``slot`` (as NIXL would); return its checksum."""
    store.pool.memoryview(slot, len(data))[:] = data
    return checksum(data)


def push(store: ChunkStore, request_id: str, ids: list[int], nbytes: int = SLOT_BYTES) -> None:
    """Reserve, write and fill every missing chunk of ``ids`` (a remote writer's job)."""
    res = store.reserve(request_id, [key(i) for i in ids], [nbytes] * len(ids))
    for index, i in enumerate(ids):
        if not res.already_present[index]:
            value = write(store, res.slots[index], payload(i, nbytes))
            store.fill(request_id, index, value, res.generations[index])


def put(store: ChunkStore, i: int) -> int:
    """Locally allocate, write and commit chunk ``i``; return its slot."""
    slot = store.allocate(key(i))
    write(store, slot, payload(i))
    store.commit(slot, key(i), SLOT_BYTES)
    return slot


def total(store: ChunkStore) -> int:
    """Sum of the slot counts by state (must equal num_slots)."""
    s = store.stats()
    return s.free + s.reserved + s.filled + s.pinned + s.quarantined
