"""Several threads reserve, fill, read, commit and abandon chunks for ~1 s.

Leases that are written to never expire (so no write can land late); leases
that are abandoned are never written and expire while a clock thread moves the
fake clock, so expiry and quarantine run concurrently with everything else.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections.abc import Callable

from fabric.errors import CapacityError, ChecksumMismatch
from fabric.store import ChunkStore, StoreConfig, checksum

from ._helpers import SLOT_BYTES, FakeClock, key, payload, total

NUM_KEYS = 32
NUM_WORKERS = 4
DURATION_S = 1.0
LONG_LEASE_MS = 10**9
PAYLOADS = [payload(i) for i in range(NUM_KEYS)]
CHECKSUMS = [checksum(data) for data in PAYLOADS]


class Worker:
    """One thread's random mix of store operations; checks every byte it reads."""

    def __init__(self, store: ChunkStore, seed: int) -> None:
        self.store = store
        self.rng = random.Random(seed)
        self.requests = 0

    def run(self, deadline: float) -> None:
        ops: list[Callable[[], None]] = [self.push] * 4 + [self.abandon]
        ops += [self.read] * 2 + [self.local] * 2 + [self.pin]
        while time.monotonic() < deadline:
            self.rng.choice(ops)()

    def ids(self) -> list[int]:
        return self.rng.sample(range(NUM_KEYS), self.rng.randint(1, 4))

    def push(self) -> None:
        ids, request_id = self.ids(), self.request_id()
        try:
            res = self.store.reserve(
                request_id, [key(i) for i in ids], [SLOT_BYTES] * len(ids), LONG_LEASE_MS
            )
        except CapacityError:
            return
        held = [
            res.already_present[index]
            or self.fill(request_id, index, i, res.slots[index], res.generations[index])
            for index, i in enumerate(ids)
        ]
        # Every chunk the reservation holds a ref on still has its bytes.
        final = self.store.reservation(request_id)
        assert final is not None
        for index, i in enumerate(ids):
            if held[index]:
                check_slot(self.store, final.slots[index], i)
        if self.rng.random() < 0.2:
            assert self.store.cancel(request_id)
        else:
            self.store.release(request_id)

    def fill(self, request_id: str, index: int, i: int, slot: int, generation: int) -> bool:
        """Write chunk ``i`` and fill it (5% with a wrong checksum); True if accepted."""
        self.store.pool.memoryview(slot)[:] = PAYLOADS[i]
        if self.rng.random() < 0.05:
            try:
                self.store.fill(request_id, index, CHECKSUMS[i] ^ 1, generation)
            except ChecksumMismatch:
                return False
            raise AssertionError("corrupt fill accepted")
        self.store.fill(request_id, index, CHECKSUMS[i], generation)
        return True

    def abandon(self) -> None:
        ids = self.ids()
        with contextlib.suppress(CapacityError):
            self.store.reserve(self.request_id(), [key(i) for i in ids], [SLOT_BYTES] * len(ids), 1)

    def read(self) -> None:
        ids = self.ids()
        slots = self.store.acquire([key(i) for i in ids])
        for slot, i in zip(slots, ids, strict=False):
            check_slot(self.store, slot, i)
        self.store.release_slots(slots)

    def local(self) -> None:
        i = self.rng.randrange(NUM_KEYS)
        try:
            slot = self.store.allocate(key(i))
        except CapacityError:
            return
        self.store.pool.memoryview(slot)[:] = PAYLOADS[i]
        if self.rng.random() < 0.2:
            self.store.abort(slot)
        else:
            assert self.store.commit(slot, key(i), SLOT_BYTES) == CHECKSUMS[i]

    def pin(self) -> None:
        keys = [key(i) for i in self.ids()]
        self.store.pin(keys)
        self.store.lookup(keys)
        self.store.unpin(keys)

    def request_id(self) -> str:
        self.requests += 1
        return f"{id(self)}-{self.requests}"


def check_slot(store: ChunkStore, slot: int, i: int) -> None:
    """The bytes in ``slot`` are chunk ``i``'s, and the store says so."""
    assert checksum(store.pool.memoryview(slot)) == CHECKSUMS[i]
    assert store.slot_checksum(slot) == CHECKSUMS[i]


def run_clock(store: ChunkStore, clock: FakeClock, stop: threading.Event) -> None:
    while not stop.wait(0.001):
        clock.advance_ms(1)
        store.expire()


def test_stress() -> None:
    clock = FakeClock()
    config = StoreConfig(slot_bytes=SLOT_BYTES, num_slots=16, quarantine_ms=5)
    store = ChunkStore(config, clock=clock)
    errors: list[BaseException] = []
    deadline = time.monotonic() + DURATION_S
    workers = [Worker(store, seed) for seed in range(NUM_WORKERS)]

    def guarded(worker: Worker) -> None:
        try:
            worker.run(deadline)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    stop = threading.Event()
    threads = [threading.Thread(target=guarded, args=(w,)) for w in workers]
    threads.append(threading.Thread(target=run_clock, args=(store, clock, stop)))
    for thread in threads:
        thread.start()
    for thread in threads[:-1]:
        thread.join()
    stop.set()
    threads[-1].join()
    if errors:
        raise errors[0]

    clock.advance_ms(10)  # abandoned leases expire, then their quarantine ends
    store.expire()
    clock.advance_ms(10)
    store.expire()
    stats = store.stats()
    assert store.reserved_count() == 0 and stats.quarantined == 0
    assert total(store) == config.num_slots
    assert sum(w.requests for w in workers) > 100
    assert stats.expired_reservations > 0 and stats.checksum_failures > 0
    assert stats.evictions > 0 and stats.cancelled_reservations > 0
    for i in range(NUM_KEYS):
        for slot in store.acquire([key(i)]):
            check_slot(store, slot, i)
