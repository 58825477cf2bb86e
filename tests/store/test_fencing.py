"""Write fences in the store: admitting writes, quarantine that waits for them, digests."""

from __future__ import annotations

import pytest

from fabric.errors import CapacityError, ReservationExpired, SlotStateError
from fabric.store import ChunkDigest, ChunkStore, SlotState, StoreConfig
from fabric.store import pool as hashing  # NOTE: the host pools hash through its compute_checksum
from fabric.store.records import DEFAULT_QUARANTINE_MS
from fabric.transfer import TransferConfig

from ._helpers import SLOT_BYTES, FakeClock, StoreFactory, key, payload, total, write


def reserve_one(store: ChunkStore, request_id: str, i: int = 0) -> tuple[int, int]:
    res = store.reserve(request_id, [key(i)], [SLOT_BYTES], lease_ms=100)
    return res.slots[0], res.generations[0]


def test_default_quarantine_outlasts_the_default_write_lifetime() -> None:
    config = StoreConfig(slot_bytes=SLOT_BYTES, num_slots=1)
    assert config.quarantine_ms == DEFAULT_QUARANTINE_MS
    assert config.quarantine_ms > TransferConfig().write_timeout_ms


def test_write_into_a_pending_chunk_is_admitted_and_ended(store: ChunkStore) -> None:
    slot, gen = reserve_one(store, "r")
    assert store.begin_write("r", [(slot, gen), (slot, gen)]) == [slot]  # one write, one slot
    with pytest.raises(SlotStateError, match="being written already"):
        store.begin_write("r", [(slot, gen)])  # never two writers in one slot
    value = write(store, slot, payload(1))
    with pytest.raises(SlotStateError, match="still being written"):
        store.fill("r", 0, value, gen)  # never verified while bytes land
    store.end_write([slot])
    store.fill("r", 0, value, gen)
    assert store.slot_state(slot) is SlotState.FILLED
    with pytest.raises(SlotStateError, match="no pending chunk"):
        store.begin_write("r", [(slot, gen)])  # filled: no more bytes


@pytest.mark.parametrize(
    ("request_id", "target", "error", "match"),
    [
        ("nobody", None, ReservationExpired, "no live reservation"),
        ("r", "stale", SlotStateError, "no pending chunk"),
        ("r", "foreign", SlotStateError, "no pending chunk"),
    ],
)
def test_write_outside_the_live_reservation_is_refused(
    store: ChunkStore, request_id: str, target: str | None, error: type, match: str
) -> None:
    slot, gen = reserve_one(store, "r", 0)
    other_slot, other_gen = reserve_one(store, "other", 1)
    targets = {
        None: (slot, gen),
        "stale": (slot, gen - 1),
        "foreign": (other_slot, other_gen),
    }[target]
    with pytest.raises(error, match=match):
        store.begin_write(request_id, [targets])
    assert store.slot_state(other_slot) is SlotState.RESERVED


def test_expired_reservation_refuses_writes_and_quarantines(
    store: ChunkStore, clock: FakeClock
) -> None:
    slot, gen = reserve_one(store, "r")
    clock.advance_ms(100)
    with pytest.raises(ReservationExpired):
        store.begin_write("r", [(slot, gen)])
    stats = store.stats()
    assert (stats.quarantined, stats.expired_reservations) == (1, 1)


def test_cancelled_reservation_quarantines_only_unfilled_slots(
    store: ChunkStore, clock: FakeClock
) -> None:
    res = store.reserve("r", [key(0), key(1)], [SLOT_BYTES] * 2)
    store.fill("r", 0, write(store, res.slots[0], payload(0)), res.generations[0])
    assert store.cancel("r")
    stats = store.stats()
    assert (stats.quarantined, stats.filled, stats.cancelled_reservations) == (1, 1, 1)
    assert store.slot_state(res.slots[1]) is SlotState.QUARANTINED
    clock.advance_ms(store.config.quarantine_ms - 1)
    store.expire()
    assert store.stats().quarantined == 1
    clock.advance_ms(1)
    store.expire()
    assert store.stats().quarantined == 0 and store.slot_state(res.slots[1]) is SlotState.FREE


def test_quarantine_waits_for_a_write_still_landing(
    make_store: StoreFactory, clock: FakeClock
) -> None:
    store = make_store(num_slots=1, quarantine_ms=50)
    slot, gen = reserve_one(store, "r")
    store.begin_write("r", [(slot, gen)])
    clock.advance_ms(100)
    store.expire()  # the lease ends: quarantined
    clock.advance_ms(50)
    store.expire()  # the quarantine ends, but the write has not
    assert store.slot_state(slot) is SlotState.QUARANTINED
    assert store.stats().quarantined == 1 and total(store) == 1
    with pytest.raises(CapacityError, match="0 free"):
        store.reserve("next", [key(9)], [SLOT_BYTES])  # not handed out mid-write
    store.end_write([slot])
    assert store.slot_state(slot) is SlotState.FREE
    assert store.slot_generation(slot) != gen
    assert reserve_one(store, "next", 9)[0] == slot


def test_write_that_began_during_verification_fails_the_fill(
    store: ChunkStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    slot, gen = reserve_one(store, "r")
    value = write(store, slot, payload(2))
    real = hashing.compute_checksum

    def racing_checksum(buf: memoryview) -> int:
        # a write admitted (and ended) while the verifier hashes the slot
        store.begin_write("r", [(slot, gen)])
        store.end_write([slot])
        return real(buf)

    monkeypatch.setattr(hashing, "compute_checksum", racing_checksum)
    with pytest.raises(SlotStateError, match="written while verified"):
        store.fill("r", 0, value, gen)
    monkeypatch.setattr(hashing, "compute_checksum", real)
    store.fill("r", 0, value, gen)  # a fill after the write is verified normally
    assert store.slot_state(slot) is SlotState.FILLED


def test_slot_digest_is_what_unpack_verifies(store: ChunkStore) -> None:
    slot = store.allocate(key(3))
    data = payload(3, SLOT_BYTES - 17)
    value = write(store, slot, data)
    assert store.slot_digest(slot) is None  # not present yet
    store.commit(slot, key(3), len(data))
    assert store.slot_digest(slot) == ChunkDigest(value, len(data))
    assert store.slot_digest((slot + 1) % store.pool.num_slots) is None


def test_released_lease_is_quarantined_past_its_deadline(
    make_store: StoreFactory, clock: FakeClock
) -> None:
    """A reader giving up does not stop the sender, which may post writes until
    the lease's deadline: quarantine_ms counts from there. A sender's own
    Cancel comes after its last write: quarantine_ms counts from now."""
    store = make_store(num_slots=2, quarantine_ms=50)
    released, _ = reserve_one(store, "reader-gave-up", 0)  # lease: 100 ms
    cancelled, _ = reserve_one(store, "sender-cancelled", 1)
    clock.advance_ms(10)
    store.release("reader-gave-up")
    store.cancel("sender-cancelled")
    clock.advance_ms(50)
    store.expire()
    assert store.slot_state(cancelled) is SlotState.FREE
    assert store.slot_state(released) is SlotState.QUARANTINED
    clock.advance_ms(100 - 10 - 1)  # 1 ms before deadline + quarantine
    store.expire()
    assert store.slot_state(released) is SlotState.QUARANTINED
    clock.advance_ms(1)
    store.expire()
    assert store.slot_state(released) is SlotState.FREE
