"""Receiver-side write fences: admit a data-plane write against the live reservations.

A plane that sees each write before its bytes land (TCP, loopback) asks its
:class:`~fabric.transfer.dataplane.WriteGuard`; a receiving node installs
:class:`StoreWriteGuard`, a send-only node :class:`RefuseWrites`::

    header: WriteFence(request_id, slots, generations) + segments
        |
        v
    every segment inside its named slot?  -- no --+
        |                                         |
    store.begin_write: live lease, a pending      +--> refused: counted, logged,
    chunk of it at that generation, no other      |    payload drained unwritten
    write landing there?                -- no ----+
        |
        v
    bytes land in the pool -> ticket.end() -> store.end_write

Nothing is written into a slot the reservation does not hold now, and a
slot being written never leaves quarantine before the write ends.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from fabric.errors import ReservationExpired, SlotStateError
from fabric.transfer.dataplane import WriteFence, WriteGuard, WriteTicket

if TYPE_CHECKING:
    from fabric.store import ChunkStore
    from fabric.transfer.dataplane import DataPlane
    from fabric.transfer.server_stats import ServerStats

logger = logging.getLogger(__name__)

WARN_EVERY_S = 10.0


def fence_targets(
    slot_bytes: int, fence: WriteFence | None, segments: Sequence[tuple[int, int]]
) -> list[tuple[int, int]]:
    """(slot, generation) of each segment; SlotStateError unless each lies in its slot."""
    if fence is None:
        raise SlotStateError("the write names no reservation")
    if not len(fence.slots) == len(fence.generations) == len(segments):
        raise SlotStateError(
            f"the fence of {fence.request_id!r} names {len(fence.slots)} slots "
            f"for {len(segments)} segments"
        )
    for (offset, nbytes), slot in zip(segments, fence.slots, strict=True):
        start = slot * slot_bytes
        if not start <= offset <= offset + nbytes <= start + slot_bytes:
            raise SlotStateError(f"segment {(offset, nbytes)} is not inside slot {slot}")
    return list(zip(fence.slots, fence.generations, strict=True))


class _StoreTicket(WriteTicket):
    def __init__(self, store: ChunkStore, slots: list[int]) -> None:
        self._store, self._slots = store, slots

    def end(self) -> None:
        slots, self._slots = self._slots, []
        self._store.end_write(slots)


class _Warner:
    """At most one warning per ``WARN_EVERY_S``; DEBUG for the rest (a flood
    of late writes must not flood the log)."""

    def __init__(self) -> None:
        self._last = -WARN_EVERY_S

    def __call__(self, message: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last < WARN_EVERY_S:
            logger.debug(message, *args)
            return
        self._last = now
        logger.warning(message + " (more like it: DEBUG for %.0f s)", *args, WARN_EVERY_S)


class StoreWriteGuard(WriteGuard):
    """Admits writes into reservations of the store ``store_of()`` returns.

    NOTE: a callable, not a store: the shared store swaps its store once
    the first engine attaches.
    """

    def __init__(self, store_of: Callable[[], ChunkStore], stats: ServerStats) -> None:
        self._store_of, self._stats = store_of, stats
        self._warn = _Warner()

    def admit(
        self, peer: str, fence: WriteFence | None, segments: Sequence[tuple[int, int]]
    ) -> WriteTicket | None:
        store = self._store_of()
        try:
            targets = fence_targets(store.pool.slot_bytes, fence, segments)
            assert fence is not None
            slots = store.begin_write(fence.request_id, targets)
        except (ReservationExpired, SlotStateError) as exc:
            self._stats.refused_writes += 1
            self._warn("refused a data-plane write from %s: %s", peer, exc)
            return None
        return _StoreTicket(store, slots)


class RefuseWrites(WriteGuard):
    """For a send-only node: nobody may write into its pool."""

    def __init__(self) -> None:
        self.refused = 0
        self._warn = _Warner()

    def admit(
        self, peer: str, fence: WriteFence | None, segments: Sequence[tuple[int, int]]
    ) -> WriteTicket | None:
        self.refused += 1
        self._warn("refused a data-plane write from %s: this node only sends", peer)
        return None


def check_quarantine(store: ChunkStore, plane: DataPlane, write_timeout_ms: int) -> None:
    """Warn when a write ``plane`` cannot refuse could outlive ``store``'s quarantine."""
    quarantine_ms = store.config.quarantine_ms
    if not plane.fences_writes and quarantine_ms < write_timeout_ms:
        logger.warning(
            "store quarantine_ms=%d is shorter than write_timeout_ms=%d: a %s write that "
            "outlives its reservation could land in a slot given to another chunk",
            quarantine_ms,
            write_timeout_ms,
            plane.kind,
        )
