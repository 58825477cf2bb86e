"""Receiver side: reserve -> bytes land -> fill -> release, leases and quarantine."""

from __future__ import annotations

import pytest

from fabric.errors import CapacityError, ChecksumMismatch, ReservationExpired, SlotStateError
from fabric.store import ChunkStore, SlotState

from ._helpers import SLOT_BYTES, FakeClock, StoreFactory, key, payload, push, put, total, write


def keys(*ids: int) -> list[bytes]:
    return [key(i) for i in ids]


def test_reserve_fill_lookup(store: ChunkStore) -> None:
    res = store.reserve("r", keys(0, 1, 2), [SLOT_BYTES, SLOT_BYTES, 100])
    assert res.already_present == (False, False, False)
    assert len(set(res.slots)) == 3 and store.reserved_count() == 3
    for index, i in enumerate((0, 1)):
        value = write(store, res.slots[index], payload(i))
        store.fill("r", index, value, res.generations[index])
    assert store.lookup(keys(0, 1, 2)) == 2
    assert store.slot_nbytes(res.slots[0]) == SLOT_BYTES
    assert store.slot_checksum(res.slots[1]) == write(store, res.slots[1], payload(1))
    store.release("r")
    assert store.reserved_count() == 0
    assert store.stats().filled == 2 and store.stats().quarantined == 1


def test_key_is_not_present_while_reserved(store: ChunkStore) -> None:
    res = store.reserve("r", keys(0), [SLOT_BYTES])
    value = write(store, res.slots[0], payload(0))
    # Bytes are in the slot, but no fill yet: not present to anyone.
    assert not store.contains(key(0))
    assert store.lookup(keys(0)) == 0 and store.acquire(keys(0)) == []
    other = store.reserve("other", keys(0), [SLOT_BYTES])
    assert other.already_present == (False,) and other.slots[0] != res.slots[0]
    store.fill("r", 0, value, res.generations[0])
    assert store.contains(key(0)) and store.lookup(keys(0)) == 1


def test_already_present_keys_are_refed_not_rewritten(store: ChunkStore) -> None:
    push(store, "p", [0])
    store.release("p")
    slot = store.acquire(keys(0))[0]
    store.release_slots([slot])
    res = store.reserve("r", keys(0, 1), [SLOT_BYTES] * 2)
    assert res.already_present == (True, False)
    assert res.slots[0] == slot and res.generations[0] == store.slot_generation(slot)
    assert store.reserved_count() == 1
    with pytest.raises(SlotStateError, match="already present"):
        store.fill("r", 0, store.slot_checksum(slot) or 0, res.generations[0])


def test_checksum_mismatch_is_counted_and_not_indexed(store: ChunkStore, clock: FakeClock) -> None:
    res = store.reserve("r", keys(0), [SLOT_BYTES])
    value = write(store, res.slots[0], payload(0))
    with pytest.raises(ChecksumMismatch, match="chunk #0"):
        store.fill("r", 0, value ^ 1, res.generations[0])
    stats = store.stats()
    assert stats.checksum_failures == 1 and stats.quarantined == 1
    assert not store.contains(key(0)) and store.reserved_count() == 0
    with pytest.raises(SlotStateError, match="failed"):
        store.fill("r", 0, value, res.generations[0])
    store.release("r")
    clock.advance_ms(store.config.quarantine_ms)
    store.expire()
    assert store.stats().free == store.config.num_slots  # not leaked
    assert store.slot_generation(res.slots[0]) > res.generations[0]


def test_lease_expiry_returns_slots_after_quarantine(store: ChunkStore, clock: FakeClock) -> None:
    res = store.reserve("r", keys(0, 1), [SLOT_BYTES] * 2, lease_ms=500)
    clock.advance_ms(499)
    assert store.expire() == 0 and store.reserved_count() == 2
    clock.advance_ms(1)
    assert store.expire() == 1
    assert store.reserved_count() == 0 and store.stats().quarantined == 2
    assert store.reservation("r") is None
    clock.advance_ms(store.config.quarantine_ms - 1)
    store.expire()
    assert store.stats().quarantined == 2
    clock.advance_ms(1)
    assert store.expire() == 0
    stats = store.stats()
    assert stats.free == store.config.num_slots and stats.expired_reservations == 1
    for slot, generation in zip(res.slots, res.generations, strict=True):
        assert store.slot_generation(slot) > generation


def test_expiry_drops_refs_of_filled_and_present_chunks(
    store: ChunkStore, clock: FakeClock
) -> None:
    push(store, "p", [0])
    store.release("p")
    res = store.reserve("r", keys(0, 1), [SLOT_BYTES] * 2, lease_ms=100)
    store.fill("r", 1, write(store, res.slots[1], payload(1)), res.generations[1])
    clock.advance_ms(100)
    assert store.expire() == 1
    # Both chunks stay present and become evictable again.
    assert store.lookup(keys(0, 1)) == 2 and store.stats().filled == 2
    assert len(store.acquire(keys(0, 1))) == 2


def test_late_fill_after_expiry_is_refused_and_ignored(store: ChunkStore, clock: FakeClock) -> None:
    res = store.reserve("r", keys(0), [SLOT_BYTES], lease_ms=100)
    clock.advance_ms(100)
    value = write(store, res.slots[0], payload(0))  # the write lands late
    with pytest.raises(ReservationExpired):
        store.fill("r", 0, value, res.generations[0])
    assert not store.contains(key(0))
    assert store.stats().quarantined == 1 and store.stats().expired_reservations == 1


def test_fill_with_stale_generation_after_slot_reuse(
    make_store: StoreFactory, clock: FakeClock
) -> None:
    store = make_store(num_slots=1, quarantine_ms=10)
    old = store.reserve("r", keys(0), [SLOT_BYTES])
    store.cancel("r")
    clock.advance_ms(10)
    new = store.reserve("r", keys(1), [SLOT_BYTES])
    assert new.slots == old.slots and new.generations[0] > old.generations[0]
    value = write(store, old.slots[0], payload(0))
    with pytest.raises(ReservationExpired, match="stale"):
        store.fill("r", 0, value, old.generations[0])
    assert store.slot_state(new.slots[0]) is SlotState.RESERVED
    store.fill("r", 0, write(store, new.slots[0], payload(1)), new.generations[0])
    assert store.contains(key(1)) and not store.contains(key(0))


def test_fill_unknown_request(store: ChunkStore) -> None:
    with pytest.raises(ReservationExpired, match="no live reservation"):
        store.fill("nope", 0, 0, 0)


def test_fill_index_out_of_range(store: ChunkStore) -> None:
    res = store.reserve("r", keys(0), [SLOT_BYTES])
    with pytest.raises(SlotStateError, match="out of range"):
        store.fill("r", 1, 0, res.generations[0])


def test_repeated_fill_is_a_no_op(store: ChunkStore) -> None:
    res = store.reserve("r", keys(0), [SLOT_BYTES])
    value = write(store, res.slots[0], payload(0))
    store.fill("r", 0, value, res.generations[0])
    store.fill("r", 0, value, res.generations[0])
    with pytest.raises(SlotStateError, match="already filled"):
        store.fill("r", 0, value ^ 1, res.generations[0])
    assert store.stats().filled == 1 and store.stats().checksum_failures == 0


def test_cancel(store: ChunkStore, clock: FakeClock) -> None:
    store.reserve("r", keys(0, 1), [SLOT_BYTES] * 2)
    assert store.cancel("r") is True
    assert store.cancel("r") is False
    stats = store.stats()
    assert stats.cancelled_reservations == 1 and stats.quarantined == 2
    assert store.reserved_count() == 0
    clock.advance_ms(store.config.quarantine_ms)
    store.expire()
    assert store.stats().free == store.config.num_slots


def test_release_is_idempotent(store: ChunkStore) -> None:
    push(store, "r", [0, 1])
    store.release("r")
    store.release("r")
    store.release("never-existed")
    assert store.stats().filled == 2 and store.reserved_count() == 0
    assert store.stats().cancelled_reservations == 0


def test_duplicate_request_id(store: ChunkStore) -> None:
    store.reserve("r", keys(0), [SLOT_BYTES])
    with pytest.raises(SlotStateError, match="already holds"):
        store.reserve("r", keys(1), [SLOT_BYTES])
    assert store.reserved_count() == 1


def test_pool_full_reserves_nothing(store: ChunkStore) -> None:
    store.pin([key(9)])  # not present: no-op
    put(store, 0)
    store.pin(keys(0))
    store.reserve("a", keys(1, 2), [SLOT_BYTES] * 2)
    before = store.stats()
    with pytest.raises(CapacityError, match="need 2 slots, 1 free"):
        store.reserve("b", keys(0, 3, 4), [SLOT_BYTES] * 3)
    assert store.stats() == before and store.reservation("b") is None
    assert store.slot_state(store.acquire(keys(0))[0]) is SlotState.PINNED


def test_present_key_in_lru_is_not_counted_as_evictable(store: ChunkStore) -> None:
    for i in range(4):
        put(store, i)
    # 4 filled, all evictable; key 0 is present, so only 3 can be evicted.
    with pytest.raises(CapacityError):
        store.reserve("r", keys(0, 5, 6, 7, 8), [SLOT_BYTES] * 5)
    res = store.reserve("r", keys(0, 5, 6, 7), [SLOT_BYTES] * 4)
    assert res.already_present == (True, False, False, False)
    assert store.contains(key(0)) and store.stats().evictions == 3


def test_heartbeat_extends_lease(store: ChunkStore, clock: FakeClock) -> None:
    res = store.reserve("r", keys(0), [SLOT_BYTES], lease_ms=100)
    clock.advance_ms(80)
    assert store.heartbeat("r", lease_ms=100)
    reservation = store.reservation("r")
    assert reservation is not None and reservation.expires_at == pytest.approx(clock.now + 0.1)
    clock.advance_ms(80)
    assert store.expire() == 0
    store.fill("r", 0, write(store, res.slots[0], payload(0)), res.generations[0])
    clock.advance_ms(20)
    assert store.expire() == 1
    assert not store.heartbeat("r")


def test_heartbeat_never_shortens(store: ChunkStore, clock: FakeClock) -> None:
    store.reserve("r", keys(0), [SLOT_BYTES], lease_ms=1000)
    assert store.heartbeat("r", lease_ms=10)
    clock.advance_ms(500)
    assert store.expire() == 0


def test_concurrent_reservations_of_one_key_dedup_on_fill(store: ChunkStore) -> None:
    a = store.reserve("a", keys(0), [SLOT_BYTES])
    b = store.reserve("b", keys(0), [SLOT_BYTES])
    assert a.slots[0] != b.slots[0]
    value_a = write(store, a.slots[0], payload(0))
    value_b = write(store, b.slots[0], payload(0))
    store.fill("b", 0, value_b, b.generations[0])  # b wins
    store.fill("a", 0, value_a, a.generations[0])  # a's slot is freed
    after = store.reservation("a")
    assert after is not None and after.slots == b.slots
    assert after.generations == (store.slot_generation(b.slots[0]),)
    assert store.slot_state(a.slots[0]) is SlotState.FREE
    assert store.slot_generation(a.slots[0]) > a.generations[0]
    # Both hold a ref: the winner survives one release and is evictable after both.
    store.release("b")
    assert store.stats().filled == 1 and store.reserved_count() == 0
    store.release("a")
    assert total(store) == store.config.num_slots


def test_late_fill_for_a_reused_request_id_is_rejected(store: ChunkStore) -> None:
    old = store.reserve("r", keys(0), [SLOT_BYTES])
    store.cancel("r")
    new = store.reserve("r", keys(0), [SLOT_BYTES])  # another slot: the old one is quarantined
    assert new.slots != old.slots
    assert new.generations[0] != old.generations[0]
    value = write(store, new.slots[0], payload(0))
    with pytest.raises(ReservationExpired):
        store.fill("r", 0, value, old.generations[0])
    store.fill("r", 0, value, new.generations[0])
    assert store.lookup(keys(0)) == 1
