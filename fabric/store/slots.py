"""Per-slot bookkeeping of the chunk store: states, key index, LRU, free list.

:class:`SlotTable` is not thread-safe: :class:`~fabric.store.chunk_store.ChunkStore`
calls it only while holding its lock. It enforces the slot state machine drawn
in :mod:`fabric.store.chunk_store` and keeps four structures consistent:

- ``index``: key -> slot, for FILLED and PINNED slots only (a key counts as
  present only once its bytes are verified);
- ``lru``: FILLED slots with no refs, oldest first (the eviction order);
- ``free_slots``: FREE slots, used as a stack;
- ``quarantine``: a heap of (due time, slot) of QUARANTINED slots;

and ``referenced``, the number of slots with refs (a reader's, a hold's or
a reservation's), which every path that ends a request brings back down.

A data plane that sees every write arrive (TCP, loopback) brackets each one
with ``begin_write``/``end_write``: a slot being written is never freed (a
due quarantine waits for the write to end) and never verified.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from fabric.errors import CapacityError, SlotStateError
from fabric.store.records import SlotState

__all__ = ["Slot", "SlotTable"]

_PRESENT = (SlotState.FILLED, SlotState.PINNED)


@dataclass(slots=True)
class Slot:
    """Metadata of one slot. ``owner`` is the request_id of a reservation's
    RESERVED slot and None for a local allocation. ``writers``: data-plane
    writes landing in it now; ``writes``: how many ever began (a verifier
    compares it before and after hashing); ``free_when_idle``: its quarantine
    is over, it is freed when the last writer ends."""

    state: SlotState = SlotState.FREE
    generation: int = 0
    key: bytes | None = None
    nbytes: int = 0
    checksum: int | None = None
    refs: int = 0
    owner: str | None = None
    writers: int = 0
    writes: int = 0
    free_when_idle: bool = False


class SlotTable:
    """Slot metadata plus the key index, the LRU, the free list and the quarantine."""

    def __init__(self, num_slots: int) -> None:
        # NOTE: generations are unique across all slots (not per slot), so a
        # late write for an old reservation can never match a new one, even
        # one that reuses the request id and lands in another slot.
        self.slots = [Slot(generation=i) for i in range(num_slots)]
        self._next_generation = num_slots
        self.index: dict[bytes, int] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()
        # NOTE: reversed so that a fresh table hands out slot 0, 1, 2, ...
        self.free_slots = list(range(num_slots - 1, -1, -1))
        self.quarantine: list[tuple[float, int]] = []
        self.counts = dict.fromkeys(SlotState, 0)
        self.counts[SlotState.FREE] = num_slots
        self.evictions = 0
        self.referenced = 0  # slots with refs > 0 (held by a reader or a reservation)

    # --- queries

    def get(self, slot: int) -> Slot:
        """The metadata of ``slot``; SlotStateError if out of range."""
        if not 0 <= slot < len(self.slots):
            raise SlotStateError(f"slot {slot} out of range [0, {len(self.slots)})")
        return self.slots[slot]

    def present(self, key: bytes) -> int | None:
        """The FILLED/PINNED slot holding ``key``, or None."""
        return self.index.get(key)

    def leading_present(self, keys: Iterable[bytes]) -> list[int]:
        """Slots of the longest run of leading keys that are present."""
        slots = []
        for key in keys:
            slot = self.index.get(key)
            if slot is None:
                break
            slots.append(slot)
        return slots

    def available(self) -> int:
        """Slots that can be taken now: FREE ones plus evictable FILLED ones."""
        return len(self.free_slots) + len(self.lru)

    def describe(self) -> str:
        """Counts by state, for error messages."""
        return ", ".join(f"{state.value}={n}" for state, n in self.counts.items())

    # --- transitions

    def take(self, key: bytes, owner: str | None, nbytes: int = 0) -> int:
        """FREE (or evicted LRU) -> RESERVED; CapacityError if neither exists."""
        if self.free_slots:
            slot = self.free_slots.pop()
        elif self.lru:
            slot = self._evict_oldest()
        else:
            raise CapacityError(f"no free or evictable slot ({self.describe()})")
        meta = self.slots[slot]
        self._set_state(meta, SlotState.RESERVED)
        meta.key, meta.owner, meta.nbytes = key, owner, nbytes
        return slot

    def fill(self, slot: int, key: bytes, nbytes: int, checksum: int, refs: int) -> None:
        """RESERVED -> FILLED: index ``key`` here, holding ``refs`` refs."""
        meta = self.slots[slot]
        assert meta.state is SlotState.RESERVED and key not in self.index
        self._set_state(meta, SlotState.FILLED)
        meta.key, meta.nbytes, meta.checksum = key, nbytes, checksum
        meta.refs, meta.owner = refs, None
        self.referenced += refs > 0
        self.index[key] = slot
        if refs == 0:
            self.lru[slot] = None

    def free(self, slot: int) -> None:
        """RESERVED/QUARANTINED/FILLED -> FREE; bumps the generation."""
        meta = self.slots[slot]
        assert meta.writers == 0, f"slot {slot} freed while being written"
        if meta.state in _PRESENT:
            assert meta.refs == 0 and meta.key is not None
            del self.index[meta.key]
            self.lru.pop(slot, None)
        self._set_state(meta, SlotState.FREE)
        meta.generation = self._next_generation
        self._next_generation += 1
        meta.key, meta.nbytes, meta.checksum, meta.refs, meta.owner = None, 0, None, 0, None
        meta.free_when_idle = False
        self.free_slots.append(slot)

    def quarantine_slot(self, slot: int, due: float) -> None:
        """RESERVED -> QUARANTINED until ``due``: a late write may still land."""
        meta = self.slots[slot]
        assert meta.state is SlotState.RESERVED
        self._set_state(meta, SlotState.QUARANTINED)
        meta.owner = None
        heapq.heappush(self.quarantine, (due, slot))

    def release_quarantine(self, now: float) -> int:
        """QUARANTINED slots due by ``now`` -> FREE; returns how many."""
        released = 0
        # NOTE: a heap, as due times are not in clock order: a released
        # lease's slots wait for its deadline first (see ChunkStore.release).
        while self.quarantine and self.quarantine[0][0] <= now:
            _, slot = heapq.heappop(self.quarantine)
            if self.slots[slot].writers:
                # NOTE: a receive into it is still copying: ``end_write`` frees it.
                self.slots[slot].free_when_idle = True
                continue
            self.free(slot)
            released += 1
        return released

    def begin_write(self, slot: int) -> None:
        """One more data-plane write landing in ``slot`` (it stays unfreeable)."""
        meta = self.slots[slot]
        meta.writers += 1
        meta.writes += 1

    def end_write(self, slot: int) -> None:
        """A write ended; free the slot if its quarantine ran out meanwhile."""
        meta = self.slots[slot]
        assert meta.writers > 0
        meta.writers -= 1
        if meta.writers == 0 and meta.free_when_idle:
            assert meta.state is SlotState.QUARANTINED
            self.free(slot)

    def add_ref(self, slot: int) -> None:
        """One more reader of a present slot; it leaves the LRU while held."""
        meta = self.slots[slot]
        assert meta.state in _PRESENT
        self.referenced += meta.refs == 0
        meta.refs += 1
        self.lru.pop(slot, None)

    def drop_ref(self, slot: int) -> None:
        """One reader fewer; a FILLED slot with no refs goes to the LRU's young end."""
        meta = self.slots[slot]
        assert meta.state in _PRESENT and meta.refs > 0
        meta.refs -= 1
        self.referenced -= meta.refs == 0
        if meta.refs == 0 and meta.state is SlotState.FILLED:
            self.lru[slot] = None

    def touch(self, slot: int) -> None:
        """Mark a present slot as just used (no-op unless it is in the LRU)."""
        if slot in self.lru:
            self.lru.move_to_end(slot)

    def pin(self, slot: int) -> None:
        """FILLED -> PINNED (never evicted). Idempotent."""
        meta = self.slots[slot]
        if meta.state is SlotState.FILLED:
            self._set_state(meta, SlotState.PINNED)
            self.lru.pop(slot, None)

    def unpin(self, slot: int) -> None:
        """PINNED -> FILLED, evictable again once no refs remain. Idempotent."""
        meta = self.slots[slot]
        if meta.state is SlotState.PINNED:
            self._set_state(meta, SlotState.FILLED)
            if meta.refs == 0:
                self.lru[slot] = None

    def _evict_oldest(self) -> int:
        """FILLED (LRU head) -> FREE, then pop it from the free list."""
        slot = next(iter(self.lru))
        self.free(slot)
        self.evictions += 1
        popped = self.free_slots.pop()
        assert popped == slot
        return slot

    def _set_state(self, meta: Slot, state: SlotState) -> None:
        self.counts[meta.state] -= 1
        self.counts[state] += 1
        meta.state = state
