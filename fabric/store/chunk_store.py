"""The chunk store: chunk key -> slot of a :class:`~fabric.store.pool.ChunkPool`.

Three kinds of callers share one store:

- a local writer (the prefiller packing into its own store):
  ``allocate`` -> write the slot -> ``commit`` (or ``abort``);
- a remote writer (a prefiller pushing into this decoder's store):
  ``reserve`` -> bytes land via NIXL/TCP -> ``fill`` per chunk -> the reader
  ``release``\\ s (or ``cancel``; ``expire`` reclaims what nobody released);
- readers (the decoder unpacking, the prefiller pushing from its slots):
  ``lookup``/``acquire`` -> read -> ``release_slots``.

Slot states::

                allocate() / reserve():           commit() / fill():
                a FREE slot, or the LRU           bytes verified
     +------+   head evicted for it   +----------+ -------------> +--------+  pin()   +--------+
     | FREE | ----------------------> | RESERVED |                | FILLED | -------> | PINNED |
     +------+                         +----------+                +--------+ <------- +--------+
      ^ ^ ^   abort(); commit()/fill()  |      |                      |       unpin()
      | | +-- that lost a dedup race ---+      |                      |
      | +------------ evicted: LRU head, refs == 0 -------------------+
      |                                        |
      |                                        | release() / cancel() / expire() before
      |  expire(): quarantine_ms passed        | its fill; fill() checksum mismatch
      |        +-------------+                 |
      +--------| QUARANTINED | <---------------+
               +-------------+

- Every return to FREE bumps the slot's generation, so a fill or write
  carrying an older generation is recognised as late and ignored.
- A key is present (``lookup``, ``contains``, ``acquire``, dedup in
  ``reserve``) only in FILLED or PINNED: a RESERVED key's bytes may still be
  in flight, and a second request must never read them (peers pain point 5).
- Bytes are fenced, not only notifications. Unfilled reserved slots are
  quarantined, not freed: the sender may still be writing into them when a
  lease runs out, and a one-sided RDMA write (NIXL) cannot be refused by the
  receiver. ``quarantine_ms`` must outlast the longest write (a sender aborts
  its writes after ``TransferConfig.write_timeout_ms`` and posts none once
  its lease ran out); it runs from the lease's deadline when the reader
  ``release``\\ s early, from now on ``cancel`` (sent after the sender's
  last write) and on expiry. A plane that sees writes arrive (TCP) also
  admits each one against the live reservation first
  (``begin_write``/``end_write``): a slot being written leaves quarantine
  only when that write ends.
- ``reserve`` never waits: a full pool raises CapacityError at once, so a
  decoder can never deadlock a prefiller that waits on it (pain point 1), and
  leases guarantee aborted requests give their slots back (pain point 2).

Every lease ends (``release``, ``cancel``, or ``expire`` at its deadline),
and every ref a reader takes is dropped by ``release_slots``:
``table_sizes`` counts live leases, RESERVED slots and referenced slots,
which all return to 0 once every request ended.

Thread safety: one lock guards all bookkeeping. It is never held while a
slot is hashed; ``commit``/``fill`` hash outside it and re-check the slot's
generation afterwards.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fabric.errors import ChecksumMismatch, ConfigError, ReservationExpired, SlotStateError
from fabric.store.leases import (
    Lease,
    LeaseTable,
    close_lease,
    fail_entry,
    fill_target,
    open_lease,
    settle_entry,
    write_slots,
)
from fabric.store.pool import ChunkPool
from fabric.store.records import ChunkDigest, Reservation, SlotState, StoreConfig, StoreStats
from fabric.store.slots import Slot, SlotTable

__all__ = ["ChunkDigest", "ChunkStore", "Reservation", "SlotState", "StoreConfig", "StoreStats"]


@dataclass
class _Counters:
    hits: int = 0
    misses: int = 0
    checksum_failures: int = 0
    expired_reservations: int = 0
    cancelled_reservations: int = 0


class ChunkStore:
    """Index of verified chunks in a fixed pool, with leases for remote writers."""

    def __init__(
        self,
        config: StoreConfig,
        pool: ChunkPool | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if pool is None:
            pool = ChunkPool(config.num_slots, config.slot_bytes)
        elif (pool.num_slots, pool.slot_bytes) != (config.num_slots, config.slot_bytes):
            raise ConfigError(
                f"pool: has {pool.num_slots} slots of {pool.slot_bytes} bytes, config "
                f"wants {config.num_slots} of {config.slot_bytes}"
            )
        self.config = config
        self.pool = pool
        self._clock = clock
        self._lock = threading.Lock()
        self._slots = SlotTable(config.num_slots)
        self._leases = LeaseTable()
        self._counters = _Counters()
        # Called (outside the lock) with each key that becomes present by a
        # commit or a fill: the disk tier's write-behind hooks in here.
        self.on_present: Callable[[bytes], None] | None = None

    # --- queries

    def lookup(self, keys: Sequence[bytes]) -> int:
        """Number of leading ``keys`` present (FILLED/PINNED); marks them used."""
        with self._lock:
            slots = self._slots.leading_present(keys)
            # Last first: the prefix's head ends up youngest in the LRU.
            for slot in reversed(slots):
                self._slots.touch(slot)
            self._counters.hits += len(slots)
            self._counters.misses += len(keys) - len(slots)
            return len(slots)

    def contains(self, key: bytes) -> bool:
        """Whether ``key`` is present (FILLED/PINNED). No LRU touch, no stats."""
        with self._lock:
            return self._slots.present(key) is not None

    def stats(self) -> StoreStats:
        """Slot counts by state and lifetime counters."""
        with self._lock:
            counts, c = self._slots.counts, self._counters
            return StoreStats(
                free=counts[SlotState.FREE],
                reserved=counts[SlotState.RESERVED],
                filled=counts[SlotState.FILLED],
                pinned=counts[SlotState.PINNED],
                quarantined=counts[SlotState.QUARANTINED],
                hits=c.hits,
                misses=c.misses,
                evictions=self._slots.evictions,
                checksum_failures=c.checksum_failures,
                expired_reservations=c.expired_reservations,
                cancelled_reservations=c.cancelled_reservations,
            )

    def has_reservation(self, request_id: str) -> bool:
        """Whether ``request_id`` holds a live reservation (cheaper than ``reservation``)."""
        with self._lock:
            return request_id in self._leases

    def table_sizes(self) -> dict[str, int]:
        """Live reservations and slots that requests hold now (name -> entries):
        all go back to 0 once every request ended, whichever way."""
        with self._lock:
            return {
                "store_leases": len(self._leases),
                "store_reserved_slots": self._slots.counts[SlotState.RESERVED],
                "store_referenced_slots": self._slots.referenced,
            }

    def has_deadlines(self) -> bool:
        """Whether something here runs out by the clock: a live reservation (its
        lease) or a quarantined slot (its due time). Without either, ``expire``
        has nothing to do until the next ``reserve``, which calls it."""
        with self._lock:
            return bool(self._leases) or bool(self._slots.quarantine)

    def allocatable(self) -> tuple[int, int]:
        """(slots an ``allocate`` could take now, all slots): the free ones
        plus the present ones nobody holds (the LRU it would evict)."""
        with self._lock:
            return self._slots.available(), len(self._slots.slots)

    def reserved_count(self) -> int:
        """Slots currently RESERVED, by local allocations and reservations."""
        with self._lock:
            return self._slots.counts[SlotState.RESERVED]

    # --- local writer

    def allocate(self, key: bytes) -> int:
        """A RESERVED slot for a local write of ``key``; evicts the LRU head if needed.

        Raises CapacityError when every slot is reserved, quarantined, pinned
        or referenced. The caller writes the slot, then ``commit``\\ s or
        ``abort``\\ s it.
        """
        with self._lock:
            self._collect_expired(self._clock())
            return self._slots.take(key, owner=None)

    def commit(self, slot: int, key: bytes, nbytes: int, checksum: int | None = None) -> int:
        """Index the locally written ``slot`` as ``key``; returns the chunk checksum.

        The checksum over the slot's first ``nbytes`` is computed when not
        given (the slot is freed if that fails). If ``key`` is already
        present, ``slot`` is freed and the existing chunk's checksum is
        returned (dedup).
        """
        self._check_nbytes("nbytes", nbytes)
        with self._lock:
            generation = self._local_slot(slot).generation
        if checksum is None:
            try:
                checksum = self.pool.checksum(slot, nbytes)
            except BaseException:
                # NOTE: a hash that fails (a VRAM pool's kernel) gives the slot
                # back, if it is still this allocation (not aborted and retaken)
                with self._lock, contextlib.suppress(SlotStateError):
                    if self._local_slot(slot).generation == generation:
                        self._slots.free(slot)
                raise
        with self._lock:
            if self._local_slot(slot).generation != generation:
                raise SlotStateError(f"slot {slot} was aborted while being committed")
            winner = self._slots.present(key)
            if winner is not None:
                self._slots.free(slot)
                winner_checksum = self._slots.slots[winner].checksum
                assert winner_checksum is not None
                return winner_checksum
            self._slots.fill(slot, key, nbytes, checksum, refs=0)
        self._notify_present(key)
        return checksum

    def abort(self, slot: int) -> None:
        """Give up a local allocation: RESERVED -> FREE.

        The caller must have finished writing (e.g. synchronised the copy
        stream): the slot may be handed out again at once.
        """
        with self._lock:
            self._local_slot(slot)
            self._slots.free(slot)

    # --- receiver side

    def reserve(
        self,
        request_id: str,
        keys: Sequence[bytes],
        nbytes: Sequence[int],
        lease_ms: int | None = None,
    ) -> Reservation:
        """Reserve slots for a remote writer, all or nothing.

        Present keys are not rewritten: a ref is held and ``already_present``
        is True. Every other key, including one another request has reserved
        but not filled yet, gets its own RESERVED slot. Raises CapacityError
        (nothing reserved) when FREE plus evictable slots do not suffice,
        SlotStateError for a request_id already in use, and ConfigError for a
        size above ``slot_bytes`` or a bad lease.
        """
        keys, sizes = tuple(keys), tuple(nbytes)
        if len(sizes) != len(keys):
            raise ConfigError(f"nbytes: {len(sizes)} sizes for {len(keys)} keys")
        for i, size in enumerate(sizes):
            self._check_nbytes(f"nbytes[{i}]", size)
        lease_s = self._lease_seconds(lease_ms)
        with self._lock:
            now = self._clock()
            self._collect_expired(now)
            if request_id in self._leases:
                raise SlotStateError(f"request {request_id!r} already holds a reservation")
            lease = open_lease(self._slots, request_id, keys, sizes, now + lease_s)
            self._leases.add(lease)
            return lease.snapshot()

    def fill(
        self,
        request_id: str,
        index: int,
        checksum: int,
        generation: int,
        *,
        actual: int | None = None,
        slot: int | None = None,
    ) -> None:
        """The bytes of key ``index`` of ``request_id`` have landed: verify and index them.

        ``actual``: the digest of the bytes of ``slot`` (required with it),
        taken by a caller that hashed them as it used them (a decoder that
        unpacked the chunk layer group by layer group as its parts landed);
        they are not hashed again, and SlotStateError is raised unless
        ``slot`` is the one the reservation holds for the key.

        On a match the key becomes present (the reservation keeps its ref
        until release). On a mismatch the slot is quarantined, the failure
        counted, and ChecksumMismatch raised. An unknown or expired request, or
        a stale ``generation``, raises ReservationExpired and changes nothing.
        Filling an already-present key, or one that failed, raises
        SlotStateError; repeating a successful fill is a no-op.
        """
        with self._lock:
            self._collect_expired(self._clock())
            lease = self._live_lease(request_id)
            target = fill_target(self._slots, lease, index, checksum, generation)
            if target is None:
                return
            if actual is not None and target[0] != slot:
                raise SlotStateError(
                    f"chunk #{index} of {request_id!r} was hashed in slot {slot}, "
                    f"its reservation holds slot {target[0]}"
                )
            slot, nbytes = target
            writes = self._slots.slots[slot].writes
        if actual is None:
            actual = self.pool.checksum(slot, nbytes)
        with self._lock:
            if self._leases.get(request_id) is not lease:
                raise ReservationExpired(f"request {request_id!r} ended while being filled")
            if fill_target(self._slots, lease, index, checksum, generation) is None:
                return
            if self._slots.slots[slot].writes != writes:
                raise SlotStateError(f"chunk #{index} (slot {slot}) was written while verified")
            if actual != checksum:
                self._counters.checksum_failures += 1
                fail_entry(self._slots, lease, index, self._quarantine_due())
                raise ChecksumMismatch(
                    f"request {request_id!r} chunk #{index} (slot {slot}): "
                    f"sent {checksum:#018x}, landed {actual:#018x}"
                )
            settle_entry(self._slots, lease, index, actual)
            key = lease.keys[index]
        self._notify_present(key)

    def release(self, request_id: str) -> None:
        """The reader is done: drop the refs, quarantine unfilled slots. Idempotent.

        NOTE: until ``quarantine_ms`` after the lease's deadline, not after
        now: its sender does not know yet and may post writes until then.
        """
        with self._lock:
            self._close(request_id, sender_stopped=False)

    def cancel(self, request_id: str) -> bool:
        """Like ``release``, counted as a cancel; returns whether the request existed.

        The sender cancels, after the last write it posts: unfilled slots are
        quarantined for ``quarantine_ms`` from now.
        """
        with self._lock:
            existed = self._close(request_id, sender_stopped=True)
            if existed:
                self._counters.cancelled_reservations += 1
            return existed

    def expire(self) -> int:
        """Close leases past their deadline; free quarantined slots that are due.

        Returns the number of reservations expired. The transfer server calls
        this periodically; ``reserve``, ``allocate``, ``fill`` and
        ``heartbeat`` also call it.
        """
        with self._lock:
            return self._collect_expired(self._clock())

    def heartbeat(self, request_id: str, lease_ms: int | None = None) -> bool:
        """Push the lease's deadline to now + ``lease_ms`` (never earlier).

        Returns False when the request is unknown or already expired.
        """
        lease_s = self._lease_seconds(lease_ms)
        with self._lock:
            now = self._clock()
            self._collect_expired(now)
            lease = self._leases.get(request_id)
            if lease is None:
                return False
            lease.expires_at = max(lease.expires_at, now + lease_s)
            return True

    def reservation(self, request_id: str) -> Reservation | None:
        """A snapshot of the reservation of ``request_id``, or None."""
        with self._lock:
            lease = self._leases.get(request_id)
            return None if lease is None else lease.snapshot()

    def begin_write(self, request_id: str, targets: Sequence[tuple[int, int]]) -> list[int]:
        """Admit a data-plane write into ``targets`` (slot, generation) of ``request_id``.

        Called by a plane that sees each write before its bytes land (TCP)
        to check it against the live reservation: ReservationExpired for a
        request with none, SlotStateError for a slot that is not one of its
        pending chunks at that generation (or is being written). Returns the
        slots to pass to ``end_write`` once the last byte landed; until then
        they are never freed (not even out of quarantine) nor verified.
        """
        with self._lock:
            self._collect_expired(self._clock())
            slots = write_slots(self._slots, self._live_lease(request_id), targets)
            for slot in slots:
                self._slots.begin_write(slot)
            return slots

    def end_write(self, slots: Sequence[int]) -> None:
        """The write ``begin_write`` admitted into ``slots`` has ended (landed or not)."""
        with self._lock:
            for slot in slots:
                self._slots.end_write(slot)

    # --- readers

    def acquire(self, keys: Sequence[bytes]) -> list[int]:
        """Slots of the leading present ``keys``, each with one more ref (unevictable)."""
        with self._lock:
            slots = self._slots.leading_present(keys)
            for slot in slots:
                self._slots.add_ref(slot)
            return slots

    def release_slots(self, slots: Sequence[int]) -> None:
        """Drop one ref per listed slot (as returned by ``acquire``). All or nothing."""
        with self._lock:
            for slot, count in Counter(slots).items():
                meta = self._slots.get(slot)
                if meta.state not in (SlotState.FILLED, SlotState.PINNED) or meta.refs < count:
                    raise SlotStateError(
                        f"slot {slot} ({meta.state.value}, {meta.refs} refs) "
                        f"cannot drop {count} ref(s)"
                    )
            for slot in reversed(slots):
                self._slots.drop_ref(slot)

    def pin(self, keys: Sequence[bytes]) -> int:
        """Pin the present ``keys`` (never evicted); returns how many were present."""
        return self._for_present(keys, self._slots.pin)

    def unpin(self, keys: Sequence[bytes]) -> int:
        """Unpin the present ``keys``; returns how many were present."""
        return self._for_present(keys, self._slots.unpin)

    def discard(self, key: bytes) -> bool:
        """Free ``key``'s slot now if nobody references it (pinned or not):
        for a chunk found corrupt at use, so later lookups miss instead of
        failing again. Returns whether it was freed."""
        with self._lock:
            slot = self._slots.index.get(key)
            if slot is None or self._slots.slots[slot].refs:
                return False
            self._slots.free(slot)
            return True

    def drop_unused(self) -> int:
        """Free every present slot nobody references (pinned ones too); returns how many.

        What readers or reservations hold stays. Used to clear the memory tier.
        """
        with self._lock:
            slots = [
                slot
                for slot, meta in enumerate(self._slots.slots)
                if meta.state in (SlotState.FILLED, SlotState.PINNED) and meta.refs == 0
            ]
            for slot in slots:
                self._slots.free(slot)
            return len(slots)

    def slot_state(self, slot: int) -> SlotState:
        """The state of ``slot``."""
        with self._lock:
            return self._slots.get(slot).state

    def slot_nbytes(self, slot: int) -> int:
        """Bytes of the chunk in ``slot`` (its reserved size while RESERVED; 0 if FREE)."""
        with self._lock:
            return self._slots.get(slot).nbytes

    def slot_checksum(self, slot: int) -> int | None:
        """Checksum of the chunk in a FILLED/PINNED ``slot``; None otherwise."""
        with self._lock:
            return self._slots.get(slot).checksum

    def slot_digest(self, slot: int, key: bytes | None = None) -> ChunkDigest | None:
        """(checksum, nbytes) of the chunk in a FILLED/PINNED ``slot``, read at once;
        None otherwise, or when ``slot`` holds another key than ``key`` (so a
        slot handed to another chunk never verifies as the one expected).
        What ``fabric.kv.unpack(..., checksum=, nbytes=)`` verifies."""
        with self._lock:
            meta = self._slots.get(slot)
            if meta.state not in (SlotState.FILLED, SlotState.PINNED) or meta.checksum is None:
                return None
            if key is not None and meta.key != key:
                return None
            return ChunkDigest(meta.checksum, meta.nbytes)

    def slot_generation(self, slot: int) -> int:
        """How many times ``slot`` has returned to FREE."""
        with self._lock:
            return self._slots.get(slot).generation

    # --- internals (callers hold the lock unless noted)

    def _notify_present(self, key: bytes) -> None:
        """Tell the listener (lock NOT held) that ``key`` became present."""
        listener = self.on_present
        if listener is not None:
            listener(key)

    def _collect_expired(self, now: float) -> int:
        expired = self._leases.take_expired(now)
        for lease in expired:
            close_lease(self._slots, lease, self._quarantine_due(now))
        self._counters.expired_reservations += len(expired)
        self._slots.release_quarantine(now)
        return len(expired)

    def _close(self, request_id: str, *, sender_stopped: bool) -> bool:
        lease = self._leases.pop(request_id)
        if lease is None:
            return False
        now = self._clock()
        start = now if sender_stopped else max(now, lease.expires_at)
        close_lease(self._slots, lease, self._quarantine_due(start))
        return True

    def _quarantine_due(self, now: float | None = None) -> float:
        start = self._clock() if now is None else now
        return start + self.config.quarantine_ms / 1000

    def _live_lease(self, request_id: str) -> Lease:
        lease = self._leases.get(request_id)
        if lease is None:
            raise ReservationExpired(f"request {request_id!r} has no live reservation")
        return lease

    def _local_slot(self, slot: int) -> Slot:
        meta = self._slots.get(slot)
        if meta.state is not SlotState.RESERVED or meta.owner is not None:
            raise SlotStateError(
                f"slot {slot} is not a local allocation ({meta.state.value}, owner={meta.owner!r})"
            )
        return meta

    def _for_present(self, keys: Sequence[bytes], action: Callable[[int], None]) -> int:
        """Apply ``action`` to the slot of every present key (lock taken here)."""
        with self._lock:
            slots = [self._slots.present(key) for key in keys]
            found = [slot for slot in slots if slot is not None]
            for slot in found:
                action(slot)
            return len(found)

    def _check_nbytes(self, field: str, nbytes: int) -> None:
        if not 0 < nbytes <= self.config.slot_bytes:
            raise ConfigError(
                f"{field}: {nbytes} bytes outside (0, slot_bytes={self.config.slot_bytes}]"
            )

    def _lease_seconds(self, lease_ms: int | None) -> float:
        ms = self.config.default_lease_ms if lease_ms is None else lease_ms
        if ms <= 0:
            raise ConfigError(f"lease_ms: must be > 0, got {ms}")
        return ms / 1000
