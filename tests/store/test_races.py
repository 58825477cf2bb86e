"""What happens when the store changes while commit()/fill() hash outside the lock.

The store's hash function is replaced by one that first runs a competing call,
which lands exactly in the window between the two locked sections.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

import fabric.store.pool as hashing  # NOTE: the host pools hash through its compute_checksum
from fabric.errors import ReservationExpired, SlotStateError
from fabric.store import ChunkStore, SlotState, checksum

from ._helpers import SLOT_BYTES, key, payload, write


def interleave(monkeypatch: pytest.MonkeyPatch, competitor: Callable[[], object]) -> None:
    """Run ``competitor`` once, inside the next unlocked hashing window."""
    calls: list[int] = []

    def hash_after_competitor(buf: memoryview) -> int:
        if not calls:
            calls.append(1)
            competitor()
        return checksum(buf)

    monkeypatch.setattr(hashing, "compute_checksum", hash_after_competitor)


def test_abort_during_commit(store: ChunkStore, monkeypatch: pytest.MonkeyPatch) -> None:
    slot = store.allocate(key(0))
    write(store, slot, payload(0))

    def abort_and_reallocate() -> None:
        store.abort(slot)
        assert store.allocate(key(1)) == slot

    interleave(monkeypatch, abort_and_reallocate)
    with pytest.raises(SlotStateError, match="aborted while being committed"):
        store.commit(slot, key(0), SLOT_BYTES)
    assert not store.contains(key(0)) and store.slot_state(slot) is SlotState.RESERVED


def test_cancel_during_fill(store: ChunkStore, monkeypatch: pytest.MonkeyPatch) -> None:
    res = store.reserve("r", [key(0)], [SLOT_BYTES])
    value = write(store, res.slots[0], payload(0))
    interleave(monkeypatch, lambda: store.cancel("r"))
    with pytest.raises(ReservationExpired, match="ended while being filled"):
        store.fill("r", 0, value, res.generations[0])
    assert not store.contains(key(0))
    assert store.slot_state(res.slots[0]) is SlotState.QUARANTINED


def test_request_id_reused_during_fill(store: ChunkStore, monkeypatch: pytest.MonkeyPatch) -> None:
    res = store.reserve("r", [key(0)], [SLOT_BYTES])
    value = write(store, res.slots[0], payload(0))

    def cancel_and_reserve_again() -> None:
        store.cancel("r")
        store.reserve("r", [key(0)], [SLOT_BYTES])

    interleave(monkeypatch, cancel_and_reserve_again)
    with pytest.raises(ReservationExpired):
        store.fill("r", 0, value, res.generations[0])
    assert not store.contains(key(0)) and store.reserved_count() == 1


def test_other_request_fills_same_key_during_fill(
    store: ChunkStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = store.reserve("a", [key(0)], [SLOT_BYTES])
    b = store.reserve("b", [key(0)], [SLOT_BYTES])
    value = write(store, a.slots[0], payload(0))
    write(store, b.slots[0], payload(0))
    interleave(monkeypatch, lambda: store.fill("b", 0, value, b.generations[0]))
    store.fill("a", 0, value, a.generations[0])
    after = store.reservation("a")
    assert after is not None and after.slots == b.slots
    assert store.slot_state(a.slots[0]) is SlotState.FREE
    assert store.stats().filled == 1 and store.reserved_count() == 0


def test_duplicate_fill_during_fill(store: ChunkStore, monkeypatch: pytest.MonkeyPatch) -> None:
    res = store.reserve("r", [key(0)], [SLOT_BYTES])
    value = write(store, res.slots[0], payload(0))
    interleave(monkeypatch, lambda: store.fill("r", 0, value, res.generations[0]))
    store.fill("r", 0, value, res.generations[0])  # the repeat is a no-op
    assert store.stats().filled == 1 and store.stats().checksum_failures == 0


def test_a_digest_taken_by_its_user_indexes_only_the_slot_it_was_taken_of(
    store: ChunkStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fill(actual=, slot=): a decoder that hashed a chunk as it unpacked it
    (no second hash here); a digest of another slot than the one the
    reservation holds (the request id reserved anew meanwhile) indexes
    nothing."""
    hashed: list[int] = []
    monkeypatch.setattr(hashing, "compute_checksum", lambda buf: hashed.append(1) or 0)
    old = store.reserve("r", [key(0)], [SLOT_BYTES])
    value = write(store, old.slots[0], payload(0))
    store.cancel("r")
    new = store.reserve("r", [key(0)], [SLOT_BYTES])
    assert new.slots[0] != old.slots[0]
    with pytest.raises(SlotStateError, match="hashed in slot"):
        store.fill("r", 0, value, new.generations[0], actual=value, slot=old.slots[0])
    assert not store.contains(key(0))
    write(store, new.slots[0], payload(0))
    store.fill("r", 0, value, new.generations[0], actual=value, slot=new.slots[0])
    assert store.contains(key(0)) and not hashed
