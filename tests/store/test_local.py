"""Local writer: allocate -> write -> commit (or abort)."""

from __future__ import annotations

import pytest

from fabric.errors import CapacityError, ConfigError, SlotStateError
from fabric.store import ChunkStore, SlotState, checksum

from ._helpers import SLOT_BYTES, key, payload, put, write


def test_allocate_commit(store: ChunkStore) -> None:
    slot = store.allocate(key(0))
    assert store.slot_state(slot) is SlotState.RESERVED and store.reserved_count() == 1
    assert not store.contains(key(0))
    expected = write(store, slot, payload(0, 100))
    assert store.commit(slot, key(0), 100) == expected
    assert store.contains(key(0)) and store.reserved_count() == 0
    assert store.slot_checksum(slot) == expected and store.slot_nbytes(slot) == 100
    assert store.acquire([key(0)]) == [slot]


def test_commit_trusts_a_given_checksum(store: ChunkStore) -> None:
    slot = store.allocate(key(0))
    assert store.commit(slot, key(0), SLOT_BYTES, checksum=1234) == 1234
    assert store.slot_checksum(slot) == 1234


def test_commit_dedups_an_existing_key(store: ChunkStore) -> None:
    first = put(store, 0)
    second = store.allocate(key(0))
    generation = store.slot_generation(second)
    write(store, second, payload(0))
    assert store.commit(second, key(0), SLOT_BYTES, checksum=99) == checksum(payload(0))
    assert store.acquire([key(0)]) == [first]
    assert store.slot_state(second) is SlotState.FREE
    assert store.slot_generation(second) > generation


def test_abort_frees_the_slot(store: ChunkStore) -> None:
    slot = store.allocate(key(0))
    generation = store.slot_generation(slot)
    store.abort(slot)
    assert store.slot_state(slot) is SlotState.FREE
    assert store.slot_generation(slot) > generation
    assert store.reserved_count() == 0 and not store.contains(key(0))
    with pytest.raises(SlotStateError, match="not a local allocation"):
        store.abort(slot)
    with pytest.raises(SlotStateError, match="not a local allocation"):
        store.commit(slot, key(0), SLOT_BYTES)


def test_reservation_slots_are_not_local(store: ChunkStore) -> None:
    res = store.reserve("r", [key(0)], [SLOT_BYTES])
    with pytest.raises(SlotStateError, match="owner='r'"):
        store.commit(res.slots[0], key(0), SLOT_BYTES)
    with pytest.raises(SlotStateError):
        store.abort(res.slots[0])


def test_commit_checks_nbytes(store: ChunkStore) -> None:
    slot = store.allocate(key(0))
    with pytest.raises(ConfigError, match=r"^nbytes:"):
        store.commit(slot, key(0), SLOT_BYTES + 1)
    assert store.slot_state(slot) is SlotState.RESERVED


@pytest.mark.parametrize("slot", [-1, 4])
def test_slot_out_of_range(store: ChunkStore, slot: int) -> None:
    with pytest.raises(SlotStateError, match="out of range"):
        store.slot_generation(slot)
    with pytest.raises(SlotStateError, match="out of range"):
        store.commit(slot, key(0), 1)


def test_allocate_when_everything_is_taken(store: ChunkStore) -> None:
    slots = [store.allocate(key(i)) for i in range(4)]
    assert sorted(slots) == [0, 1, 2, 3]
    with pytest.raises(CapacityError, match="reserved=4"):
        store.allocate(key(9))
    store.abort(slots[2])
    assert store.allocate(key(9)) == slots[2]
