"""The reuse tier: prompt-level lookups over the chunk store and its disk tier.

:class:`TieredStore` turns token ids into chunk keys (full chunks only, the
layout fingerprint folded in) and answers the questions an engine and the
proxy ask before computing a prompt::

    lookup(tokens)                 how many leading full chunks are held?
                                   (memory first, then the disk tier)
    lookup(tokens, hold=rid)       ... and keep them for request ``rid``:
                                   disk hits are read back into pool slots
                                   (checksum verified), every hit slot gets
                                   a ref until the worker ``take_hold``\\ s
                                   it or the hold's lease runs out
    pin / clear                    admin: never evict a prefix; empty a tier

Write-behind to disk: the store calls :meth:`TieredStore._on_present` for
every key that becomes present (a local pack committed, a pushed chunk
verified); a writer thread copies those slots to the disk tier while holding
a ref, so a chunk evicted from memory later is still on disk, and a
restarted engine finds what its predecessor computed. A chunk evicted before
the writer reached it is skipped and counted (``disk_skipped``).

Every hold ends: the worker takes it (``take_held``), the scheduler lets
it go (``release_hold``), a newer lookup for the same request replaces it
(the old refs are dropped, even when two lookups race), its lease runs out
(``expire_holds``, called by the transfer server's loop), or ``close``. A
lookup that raises midway (a disk read failing) drops the refs it took and
aborts the slot it was reading into.

A release can overtake the lookup it answers. With a disk tier a lookup
that holds runs on a server thread, and the scheduler's release of the
same request is applied by the worker in-process (or by a Release on the
server's loop), so it may run while that lookup still reads chunks in::

    offload thread                        worker / loop
    lookup(hold=r) begins: r pending
      reading chunk 2 from disk ...       release_hold(r): no hold yet;
                                          r's release counted
    lookup ends: released since it        (nobody would release r again:
      began -> its refs dropped, no hold   it would wait out its lease)

So every lookup that holds is registered, per request, while it runs, and
a ``release_hold`` of that request counts against the lookups running
then: each of them drops what it took when it ends (``holds_cancelled``)
instead of keeping it. The register is bounded by the lookups in flight (an
entry goes with the last of its request's), so nothing is kept for the
requests released when no lookup ran. NOTE: a lookup for the same request
sent after the release was decided but begun before it was applied is
dropped too: a miss for that request (vLLM computes it), never a leak.
``close`` drops the holds of lookups that end after it in the same way.

``table_sizes`` reports the holds, the lookups that hold in flight, the
disk writes queued and the disk tier's writers in flight.

Thread safety: holds are guarded by one lock; the store and the disk tier
have their own. Disk reads and writes never run under the holds lock.
Lookups that hold, pins and clears read or delete files: the transfer
server runs them off its loop.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fabric.errors import CapacityError, ConfigError, SlotStateError
from fabric.kv.identity import BASE, KeyIdentity
from fabric.kv.keys import chunk_keys
from fabric.store.checksum import checksum as compute_checksum
from fabric.threads import thread as named_thread

if TYPE_CHECKING:
    from fabric.store.chunk_store import ChunkStore
    from fabric.store.disk import DiskTier

logger = logging.getLogger(__name__)

TIERS = ("memory", "disk", "all")


@dataclass(frozen=True)
class Hit:
    """Result of a lookup: ``chunks`` leading full chunks held, ``disk`` of
    them found only on disk; ``slots`` are the held pool slots (hold only)."""

    chunks: int
    disk: int
    slots: tuple[int, ...] = ()


@dataclass
class _Hold:
    slots: list[int]
    expires_at: float
    keys: list[bytes] = field(default_factory=list)  # the key each slot was held as


@dataclass
class _Pending:
    """The lookups that hold for one request, running now."""

    lookups: int = 0
    releases: int = 0  # release_hold calls of the request since the first began


@dataclass
class TierCounters:
    """Monotonic counters of a TieredStore (updated under its lock: lookups,
    the disk writer and the server's loop all count)."""

    lookups: int = 0
    hit_chunks: int = 0
    disk_hit_chunks: int = 0
    disk_read_failures: int = 0
    disk_writes_queued: int = 0
    disk_skipped: int = 0
    holds_expired: int = 0
    holds_cancelled: int = 0  # a lookup's hold dropped: released (or closed) while it read


@dataclass
class _Writer:
    queue: queue.Queue[bytes | None] = field(default_factory=queue.Queue)
    pending: int = 0
    idle: threading.Condition = field(default_factory=threading.Condition)


class TieredStore:
    """Prompt lookups, holds and disk write-behind over one :class:`ChunkStore`."""

    def __init__(
        self,
        store: ChunkStore,
        *,
        chunk_tokens: int,
        fingerprint: str,
        disk: DiskTier | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if chunk_tokens < 1:
            raise ConfigError(f"chunk_tokens: must be >= 1, got {chunk_tokens}")
        self.store, self.disk = store, disk
        self.chunk_tokens, self.fingerprint = chunk_tokens, fingerprint
        self.counters = TierCounters()
        self._clock = clock
        self._lock = threading.Lock()
        self._holds: dict[str, _Hold] = {}
        self._pending: dict[str, _Pending] = {}  # request -> its holding lookups running
        self._closed = False
        self._writer = _Writer()
        self._thread: threading.Thread | None = None
        if disk is not None:
            store.on_present = self._on_present
            self._thread = named_thread(self._write_loop, name="fabric-disk")
            self._thread.start()

    # ------------------------------------------------------------ lookups
    def keys(self, token_ids: Sequence[int], identity: KeyIdentity = BASE) -> list[bytes]:
        """Keys of the full chunks of ``token_ids`` for a request of ``identity``."""
        return chunk_keys(
            token_ids,
            self.chunk_tokens,
            self.fingerprint,
            include_partial=False,
            identity=identity,
        )

    def lookup(
        self,
        token_ids: Sequence[int],
        *,
        hold: str | None = None,
        lease_ms: int = 30_000,
        identity: KeyIdentity = BASE,
    ) -> Hit:
        """Leading full chunks of ``token_ids`` held in memory or on disk.

        With ``hold`` (a request id) the hit chunks are brought into memory
        and referenced for that request; a previous hold of the same id is
        dropped first. A chunk that cannot be brought in (no free slot, a
        corrupt file) ends the hit there. When ``release_hold(hold)`` ran
        while this lookup read (see the module docstring) nothing is held:
        the hit is returned without ``slots``.
        """
        keys = self.keys(token_ids, identity)
        hit = self._count(keys) if hold is None else self._lookup_hold(hold, keys, lease_ms)
        self._count_up(lookups=1, hit_chunks=hit.chunks, disk_hit_chunks=hit.disk)
        return hit

    def _lookup_hold(self, request_id: str, keys: list[bytes], lease_ms: int) -> Hit:
        """Acquire the hit for ``request_id``, registered as pending meanwhile."""
        with self._lock:
            previous = self._holds.pop(request_id, None)
            pending = self._pending.setdefault(request_id, _Pending())
            pending.lookups += 1
            began = pending.releases
        if previous is not None:
            self.store.release_slots(previous.slots)
        hit = Hit(0, 0)
        try:
            hit = self._acquire(keys)
        finally:  # NOTE: _acquire dropped its refs if it raised: only unregister
            kept = self._keep(request_id, began, hit, keys[: hit.chunks], lease_ms)
        return hit if kept else Hit(hit.chunks, hit.disk)

    def _keep(
        self, request_id: str, began: int, hit: Hit, keys: list[bytes], lease_ms: int
    ) -> bool:
        """End a lookup of ``request_id`` begun after ``began`` releases: keep
        its slots as the request's hold unless it was released (or the tier
        closed) meanwhile, then they go back. A hold that raced in from
        another lookup of the same id is replaced (its refs dropped)."""
        with self._lock:
            pending = self._pending[request_id]
            pending.lookups -= 1
            if not pending.lookups:
                del self._pending[request_id]
            keep = bool(hit.slots) and pending.releases == began and not self._closed
            previous = None
            if keep:
                expires_at = self._clock() + lease_ms / 1000
                previous = self._holds.get(request_id)
                self._holds[request_id] = _Hold(list(hit.slots), expires_at, keys)
            elif hit.slots:
                self.counters.holds_cancelled += 1
        if previous is not None:
            self.store.release_slots(previous.slots)
        if hit.slots and not keep:
            self.store.release_slots(list(hit.slots))
        return keep

    def take_hold(self, request_id: str) -> list[int] | None:
        """The slots held for ``request_id`` (the caller now owns their refs)."""
        held = self.take_held(request_id)
        return None if held is None else held[0]

    def take_held(self, request_id: str) -> tuple[list[int], list[bytes]] | None:
        """(slots, the key each was held as) for ``request_id``; the caller
        now owns the slots' refs (and checks the keys at use)."""
        with self._lock:
            hold = self._holds.pop(request_id, None)
        return None if hold is None else (hold.slots, hold.keys)

    def release_hold(self, request_id: str) -> bool:
        """Drop the hold of ``request_id``, and what its lookups running now
        take (they end holding nothing); returns whether there was a hold."""
        with self._lock:
            hold = self._holds.pop(request_id, None)
            pending = self._pending.get(request_id)
            if pending is not None:
                pending.releases += 1
        if hold is None:
            return False
        self.store.release_slots(hold.slots)
        return True

    def expire_holds(self) -> int:
        """Drop holds past their lease (their request never loaded them)."""
        now = self._clock()
        with self._lock:
            gone = [rid for rid, hold in self._holds.items() if hold.expires_at <= now]
            slots = [self._holds.pop(rid).slots for rid in gone]
        for held in slots:
            self.store.release_slots(held)
        self._count_up(holds_expired=len(gone))
        return len(gone)

    def held_count(self) -> int:
        """Requests with a hold now."""
        with self._lock:
            return len(self._holds)

    def table_sizes(self) -> dict[str, int]:
        """Holds, requests with a holding lookup running, disk writes queued
        and the disk tier's writers (name -> entries)."""
        with self._writer.idle:
            pending = self._writer.pending
        with self._lock:
            holds, lookups = len(self._holds), len(self._pending)
        sizes = {"tier_holds": holds, "tier_lookups": lookups, "tier_disk_queue": pending}
        if self.disk is not None:
            sizes |= self.disk.table_sizes()
        return sizes

    # ------------------------------------------------------------ admin
    def pin(
        self, token_ids: Sequence[int], *, pin: bool = True, identity: KeyIdentity = BASE
    ) -> int:
        """Pin (bring in from disk first) or unpin a prompt's leading chunks."""
        keys = self.keys(token_ids, identity)
        if not pin:
            return self.store.unpin(keys)
        hit = self._acquire(keys)
        try:
            return self.store.pin(keys[: hit.chunks])
        finally:
            self.store.release_slots(list(hit.slots))

    def clear(self, tier: str = "all") -> int:
        """Empty ``"memory"`` (chunks nobody holds), ``"disk"`` or ``"all"``."""
        if tier not in TIERS:
            raise ConfigError(f"tier: {tier!r} is not one of {TIERS}")
        # NOTE: the disk writer holds a ref on the slot it copies; let it
        # finish first so every unused chunk is dropped.
        self.flush()
        count = 0
        if tier in ("memory", "all"):
            count += self.store.drop_unused()
        if tier in ("disk", "all") and self.disk is not None:
            count += self.disk.clear()
        return count

    def flush(self, timeout: float = 60.0) -> bool:
        """Wait until the disk writer has written what was queued."""
        deadline = time.monotonic() + timeout
        with self._writer.idle:
            while self._writer.pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._writer.idle.wait(left)
        return True

    def close(self) -> None:
        """Stop the disk writer (after what is queued) and drop every hold;
        a lookup still running keeps nothing when it ends."""
        with self._lock:
            self._closed = True
        if self._thread is not None:
            self.store.on_present = None
            self._writer.queue.put(None)
            self._thread.join(timeout=30)
            self._thread = None
        with self._lock:
            holds, self._holds = list(self._holds.values()), {}
        for hold in holds:
            self.store.release_slots(hold.slots)

    # ------------------------------------------------------------ internals
    def _count_up(self, **deltas: int) -> None:
        with self._lock:  # NOTE: several threads count at once
            for name, delta in deltas.items():
                setattr(self.counters, name, getattr(self.counters, name) + delta)

    def _count(self, keys: list[bytes]) -> Hit:
        chunks = disk = 0
        for key in keys:
            if self.store.contains(key):
                chunks += 1
            elif self.disk is not None and self.disk.contains(key):
                chunks += 1
                disk += 1
            else:
                break
        return Hit(chunks, disk)

    def _acquire(self, keys: list[bytes]) -> Hit:
        """Reference the leading present chunks, reading disk-only ones in.

        On an exception the refs taken so far are dropped before it propagates."""
        slots: list[int] = []
        disk = 0
        try:
            for key in keys:
                got = self.store.acquire([key])
                if got:
                    slots.append(got[0])
                    continue
                if self.disk is None or not self.disk.contains(key):
                    break
                slot = self._read_in(key)
                if slot is None:
                    break
                slots.append(slot)
                disk += 1
        except BaseException:
            self.store.release_slots(slots)
            raise
        return Hit(len(slots), disk, tuple(slots))

    def _read_in(self, key: bytes) -> int | None:
        """Bring ``key`` from disk into a slot, referenced; None if it cannot."""
        assert self.disk is not None
        try:
            slot = self.store.allocate(key)
        except CapacityError as exc:
            logger.info("fabric: no slot to read a chunk back from disk: %s", exc)
            return None
        try:
            nbytes = self._read_from_disk(key, slot)
            if nbytes is not None:
                self.store.commit(slot, key, nbytes)
        except BaseException:
            # NOTE: not committed (or committed never): the slot must not stay RESERVED.
            with contextlib.suppress(SlotStateError):
                self.store.abort(slot)
            raise
        if nbytes is None:
            self.store.abort(slot)
            self._count_up(disk_read_failures=1)
            return None
        got = self.store.acquire([key])
        return got[0] if got else None

    def _read_from_disk(self, key: bytes, slot: int) -> int | None:
        """Read ``key`` from disk into ``slot``; its size, or None (absent, corrupt).

        Host pools are read into straight; a VRAM pool's chunk goes through a
        pinned staging buffer (the disk verified it there) and one copy up.
        The caller commits the slot, which hashes it with the pool's checksum.
        """
        assert self.disk is not None
        pool = self.store.pool
        if pool.is_host:
            return self.disk.read_into(key, pool.slot_view(slot))
        staging = pool.staging_buffer()
        nbytes = self.disk.read_into(key, staging)
        if nbytes is not None:
            pool.slot_view(slot).narrow(0, 0, nbytes).copy_(staging.narrow(0, 0, nbytes))
        return nbytes

    def _on_present(self, key: bytes) -> None:
        with self._writer.idle:
            self._writer.pending += 1
        self._count_up(disk_writes_queued=1)
        self._writer.queue.put(key)

    def _write_loop(self) -> None:
        assert self.disk is not None
        while (key := self._writer.queue.get()) is not None:
            try:
                self._write_one(key)
            except Exception:
                logger.exception("fabric: disk write-behind failed")
            finally:
                with self._writer.idle:
                    self._writer.pending -= 1
                    self._writer.idle.notify_all()

    def _write_one(self, key: bytes) -> None:
        assert self.disk is not None
        if self.disk.contains(key):
            return
        got = self.store.acquire([key])
        if not got:
            self._count_up(disk_skipped=1)
            return
        slot = got[0]
        try:
            checksum = self.store.slot_checksum(slot)
            nbytes = self.store.slot_nbytes(slot)
            assert checksum is not None
            pool = self.store.pool
            if pool.is_host:
                self.disk.put(key, pool.memoryview(slot, nbytes), checksum)
            else:
                # NOTE: the disk's files carry xxh3 of their bytes, not the
                # VRAM pool's fold64: the slot is checked against the
                # checksum it was committed under first (a host pool's file
                # carries that one, and a slot changed since fails at read),
                # then the staged copy is hashed
                if pool.checksum(slot, nbytes) != checksum:
                    logger.warning("fabric: chunk %s changed in its slot; not saved", key.hex())
                    self._count_up(disk_skipped=1)
                    return
                staging = pool.staging_buffer().narrow(0, 0, nbytes)
                staging.copy_(pool.slot_view(slot).narrow(0, 0, nbytes))
                self.disk.put(key, staging, compute_checksum(staging))
        finally:
            self.store.release_slots([slot])
