"""LRU eviction of unpinned, unreferenced FILLED slots."""

from __future__ import annotations

import pytest

from fabric.errors import CapacityError, SlotStateError
from fabric.store import ChunkStore, SlotState

from ._helpers import SLOT_BYTES, key, push, put


def evicted_order(store: ChunkStore, ids: list[int]) -> list[int]:
    """Allocate one slot at a time and report which of ``ids`` disappeared."""
    order = []
    for n in range(len(ids)):
        store.allocate(key(1000 + n))
        gone = [i for i in ids if not store.contains(key(i)) and i not in order]
        assert len(gone) == 1
        order += gone
    return order


def test_lru_evicts_least_recently_used_first(store: ChunkStore) -> None:
    for i in range(4):
        put(store, i)
    store.lookup([key(1)])
    assert evicted_order(store, [0, 1, 2, 3]) == [0, 2, 3, 1]
    assert store.stats().evictions == 4


def test_lookup_keeps_a_prefix_head_longest(store: ChunkStore) -> None:
    for i in range(4):
        put(store, i)
    store.lookup([key(0), key(1), key(2), key(3)])
    # The tail of a prefix goes first: without its head it can never hit.
    assert evicted_order(store, [0, 1, 2, 3]) == [3, 2, 1, 0]


def test_released_reservation_enters_lru_tail_first(store: ChunkStore) -> None:
    push(store, "r", [0, 1, 2, 3])
    store.release("r")
    assert evicted_order(store, [0, 1, 2, 3]) == [3, 2, 1, 0]


def test_pinned_is_never_evicted(store: ChunkStore) -> None:
    for i in range(4):
        put(store, i)
    assert store.pin([key(0), key(2), key(7)]) == 2
    assert store.stats().pinned == 2
    store.allocate(key(10))
    store.allocate(key(11))
    with pytest.raises(CapacityError, match="pinned=2"):
        store.allocate(key(12))
    assert store.contains(key(0)) and store.contains(key(2))
    assert store.unpin([key(0), key(2)]) == 2
    store.allocate(key(12))
    assert store.stats().pinned == 0 and not store.contains(key(0))


def test_pin_is_idempotent_and_keeps_refs(store: ChunkStore) -> None:
    slot = put(store, 0)
    assert store.acquire([key(0)]) == [slot]
    store.pin([key(0)])
    store.pin([key(0)])
    assert store.slot_state(slot) is SlotState.PINNED
    store.release_slots([slot])
    store.unpin([key(0)])
    assert store.slot_state(slot) is SlotState.FILLED
    store.lookup([key(0)])  # touch; evictable again
    for i in range(4):
        store.allocate(key(10 + i))
    assert not store.contains(key(0))


def test_referenced_slots_are_not_evicted(store: ChunkStore) -> None:
    for i in range(4):
        put(store, i)
    held = store.acquire([key(0), key(1), key(2), key(3)])
    with pytest.raises(CapacityError):
        store.allocate(key(10))
    with pytest.raises(CapacityError):
        store.reserve("r", [key(10)], [SLOT_BYTES])
    store.release_slots(held[2:3])
    store.allocate(key(10))
    assert not store.contains(key(2))
    assert all(store.contains(key(i)) for i in (0, 1, 3))


def test_nested_refs(store: ChunkStore) -> None:
    slot = put(store, 0)
    store.acquire([key(0)])
    store.acquire([key(0)])
    store.release_slots([slot])
    for i in range(3):
        store.allocate(key(10 + i))
    with pytest.raises(CapacityError):
        store.allocate(key(13))
    store.release_slots([slot])
    store.allocate(key(13))
    assert not store.contains(key(0))


def test_release_slots_is_all_or_nothing(store: ChunkStore) -> None:
    a, b = put(store, 0), put(store, 1)
    store.acquire([key(0)])
    with pytest.raises(SlotStateError, match=f"slot {a} .* cannot drop 2"):
        store.release_slots([a, a])
    with pytest.raises(SlotStateError, match=f"slot {b} "):
        store.release_slots([a, b])
    store.release_slots([a])  # the failed calls dropped nothing
    with pytest.raises(SlotStateError, match=f"slot {a} "):
        store.release_slots([a])


def test_acquire_stops_at_first_missing_key(store: ChunkStore) -> None:
    put(store, 0)
    put(store, 2)
    assert len(store.acquire([key(0), key(1), key(2)])) == 1


def test_lookup_counts_hits_and_misses(store: ChunkStore) -> None:
    put(store, 0)
    put(store, 2)
    assert store.lookup([key(0), key(1), key(2)]) == 1
    stats = store.stats()
    assert (stats.hits, stats.misses) == (1, 2)
