"""Receiver-side reservations (leases) of the chunk store.

A :class:`Lease` is the mutable record behind a
:class:`~fabric.store.records.Reservation`; :class:`LeaseTable` maps
request_id -> lease and finds the ones whose deadline has passed; the
functions ``open_lease``, ``write_slots``, ``fill_target``, ``settle_entry``,
``fail_entry`` and ``close_lease`` move a lease's slots through the
:class:`~fabric.store.slots.SlotTable`.
None of it is thread-safe: :class:`~fabric.store.chunk_store.ChunkStore` calls it
under its lock.

Each key of a lease is one entry::

    PENDING --fill ok--> HELD       (ref held on the slot until release)
       |
       +--fill bad--> FAILED        (slot quarantined, nothing held)

    already-present keys start HELD.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass

from fabric.errors import CapacityError, ReservationExpired, SlotStateError
from fabric.store.records import Reservation
from fabric.store.slots import SlotTable

__all__ = [
    "Entry",
    "Lease",
    "LeaseTable",
    "close_lease",
    "fail_entry",
    "fill_target",
    "open_lease",
    "settle_entry",
    "write_slots",
]


class Entry(enum.Enum):
    """State of one key of a lease."""

    PENDING = "pending"
    HELD = "held"
    FAILED = "failed"


@dataclass(slots=True)
class Lease:
    """One reservation: per-key slots, generations, sizes and entry states."""

    request_id: str
    keys: tuple[bytes, ...]
    nbytes: tuple[int, ...]
    slots: list[int]
    generations: list[int]
    already_present: tuple[bool, ...]
    entries: list[Entry]
    expires_at: float

    def snapshot(self) -> Reservation:
        """The frozen public view of this lease as it is now."""
        return Reservation(
            request_id=self.request_id,
            keys=self.keys,
            slots=tuple(self.slots),
            generations=tuple(self.generations),
            already_present=self.already_present,
            expires_at=self.expires_at,
            nbytes=self.nbytes,
        )


class LeaseTable:
    """request_id -> Lease, with a cheap check for "has anything expired?"."""

    def __init__(self) -> None:
        self._leases: dict[str, Lease] = {}
        # NOTE: a lower bound on every live deadline (heartbeats only push
        # deadlines later), so take_expired() skips the scan until it passes.
        self._next_deadline = math.inf

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._leases

    def __len__(self) -> int:
        return len(self._leases)

    def get(self, request_id: str) -> Lease | None:
        """The live lease of ``request_id``, or None."""
        return self._leases.get(request_id)

    def add(self, lease: Lease) -> None:
        """Track a new lease (the caller has checked request_id is unused)."""
        assert lease.request_id not in self._leases
        self._leases[lease.request_id] = lease
        self._next_deadline = min(self._next_deadline, lease.expires_at)

    def pop(self, request_id: str) -> Lease | None:
        """Forget and return the lease of ``request_id`` (None if unknown)."""
        return self._leases.pop(request_id, None)

    def take_expired(self, now: float) -> list[Lease]:
        """Remove and return the leases whose deadline is at or before ``now``."""
        if now < self._next_deadline:
            return []
        expired = [lease for lease in self._leases.values() if lease.expires_at <= now]
        for lease in expired:
            del self._leases[lease.request_id]
        deadlines = (lease.expires_at for lease in self._leases.values())
        self._next_deadline = min(deadlines, default=math.inf)
        return expired


def open_lease(
    table: SlotTable,
    request_id: str,
    keys: tuple[bytes, ...],
    nbytes: tuple[int, ...],
    expires_at: float,
) -> Lease:
    """Take a ref on every present key and a RESERVED slot for every other key.

    All or nothing: CapacityError, with nothing changed, when the FREE plus
    evictable slots cannot cover the missing keys.
    """
    present = [table.present(key) for key in keys]
    _check_capacity(table, present)
    # NOTE: refs first, so the evictions below can never pick a slot this
    # very reservation counts as present.
    for slot in present:
        if slot is not None:
            table.add_ref(slot)
    slots = [
        table.take(key, request_id, size) if slot is None else slot
        for key, size, slot in zip(keys, nbytes, present, strict=True)
    ]
    return Lease(
        request_id=request_id,
        keys=keys,
        nbytes=nbytes,
        slots=slots,
        generations=[table.slots[slot].generation for slot in slots],
        already_present=tuple(slot is not None for slot in present),
        entries=[Entry.PENDING if slot is None else Entry.HELD for slot in present],
        expires_at=expires_at,
    )


def _check_capacity(table: SlotTable, present: list[int | None]) -> None:
    missing = sum(slot is None for slot in present)
    # Present slots sitting in the LRU stop being evictable once we ref them.
    refed_lru = {slot for slot in present if slot is not None and slot in table.lru}
    available = table.available() - len(refed_lru)
    if missing > available:
        raise CapacityError(
            f"need {missing} slots, {available} free or evictable ({table.describe()})"
        )


def write_slots(table: SlotTable, lease: Lease, targets: Sequence[tuple[int, int]]) -> list[int]:
    """The slots a data-plane write into ``targets`` (slot, generation) may land in.

    Each target must be an entry of ``lease`` still waiting for its bytes, at
    the generation the reservation handed out, with no other write landing
    in it: SlotStateError (naming the first that is not) otherwise.
    """
    pending = {
        (slot, generation): index
        for index, (slot, generation) in enumerate(zip(lease.slots, lease.generations, strict=True))
        if lease.entries[index] is Entry.PENDING
    }
    slots = []
    for slot, generation in dict.fromkeys(targets):
        index = pending.get((slot, generation))
        if index is None:
            raise SlotStateError(
                f"slot {slot} generation {generation} is no pending chunk of {lease.request_id!r}"
            )
        if table.slots[slot].writers:
            raise SlotStateError(f"chunk #{index} (slot {slot}) is being written already")
        slots.append(slot)
    return slots


def fill_target(
    table: SlotTable, lease: Lease, index: int, checksum: int, generation: int
) -> tuple[int, int] | None:
    """(slot, nbytes) to verify before entry ``index`` can be settled.

    None for a repeated fill of an entry already filled with the same bytes.
    SlotStateError for a bad index, an already-present key, a failed entry or
    a slot a data-plane write is landing in;
    ReservationExpired for a stale ``generation``.
    """
    if not 0 <= index < len(lease.keys):
        raise SlotStateError(f"chunk #{index} out of range for {len(lease.keys)} keys")
    entry, slot = lease.entries[index], lease.slots[index]
    if lease.already_present[index]:
        raise SlotStateError(f"chunk #{index} was already present; nothing to fill")
    if entry is Entry.FAILED:
        raise SlotStateError(f"chunk #{index} already failed its checksum")
    if entry is Entry.HELD:
        if table.slots[slot].checksum == checksum:
            return None
        raise SlotStateError(f"chunk #{index} was already filled with other bytes")
    if table.slots[slot].writers:
        raise SlotStateError(f"chunk #{index} (slot {slot}) is still being written")
    if generation != lease.generations[index]:
        raise ReservationExpired(
            f"chunk #{index}: generation {generation} is stale "
            f"(slot {slot} is at {lease.generations[index]})"
        )
    return slot, lease.nbytes[index]


def settle_entry(table: SlotTable, lease: Lease, index: int, checksum: int) -> None:
    """Entry ``index`` was verified: index its slot (ref held) or lose the dedup race.

    When another slot already holds the key (a concurrent reservation filled
    it first, or a local commit), this slot is freed and the lease holds a
    ref on the winner instead.
    """
    slot, key = lease.slots[index], lease.keys[index]
    winner = table.present(key)
    if winner is None:
        table.fill(slot, key, lease.nbytes[index], checksum, refs=1)
    else:
        table.free(slot)
        table.add_ref(winner)
        lease.slots[index] = winner
        lease.generations[index] = table.slots[winner].generation
    lease.entries[index] = Entry.HELD


def fail_entry(table: SlotTable, lease: Lease, index: int, due: float) -> None:
    """Entry ``index`` failed verification: quarantine its slot until ``due``."""
    table.quarantine_slot(lease.slots[index], due)
    lease.entries[index] = Entry.FAILED


def close_lease(table: SlotTable, lease: Lease, due: float) -> None:
    """Drop the lease's refs and quarantine its unfilled slots until ``due``."""
    # NOTE: last key first, so a prefix's tail lands older in the LRU and is
    # evicted before its head (a head chunk is shared by more prompts).
    for index in reversed(range(len(lease.keys))):
        entry, slot = lease.entries[index], lease.slots[index]
        if entry is Entry.HELD:
            table.drop_ref(slot)
        elif entry is Entry.PENDING:
            table.quarantine_slot(slot, due)
