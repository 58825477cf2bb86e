"""Value types of the chunk store: slot states, config, reservations, stats.

They live apart from :mod:`fabric.store.chunk_store` so the bookkeeping modules can
share them; ``fabric.store.chunk_store`` and ``fabric.store`` re-export all of them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Annotated, NamedTuple

from pydantic import Field

from fabric.settings import Settings

__all__ = [
    "DEFAULT_QUARANTINE_MS",
    "ChunkDigest",
    "Reservation",
    "SlotState",
    "StoreConfig",
    "StoreStats",
]

DEFAULT_QUARANTINE_MS = 35_000
"""Default ``StoreConfig.quarantine_ms``: the default longest write lifetime
(``TransferConfig.write_timeout_ms``, 30 s, the connector's push timeout too)
plus 5 s for a sender's scheduling and clock granularity."""


class SlotState(enum.Enum):
    """Where a slot is in its life cycle (diagram in :mod:`fabric.store.chunk_store`)."""

    FREE = "free"
    RESERVED = "reserved"
    FILLED = "filled"
    PINNED = "pinned"
    QUARANTINED = "quarantined"


Count = Annotated[int, Field(strict=True, ge=1)]


class StoreConfig(Settings):
    """Configuration of one :class:`~fabric.store.chunk_store.ChunkStore`.

    ``quarantine_ms`` is how long an expired, cancelled or corrupt reserved
    slot waits before it can be handed out again, so a late remote write
    cannot land in another request's slot. It must be at least the longest
    a write posted into this store can live: senders abort a write after
    ``TransferConfig.write_timeout_ms`` and post none once their lease ran
    out, so the default (:data:`DEFAULT_QUARANTINE_MS`) is that timeout's
    default plus a margin; lower both together. ``default_lease_ms`` is the
    lease of a reservation that does not name one.
    """

    slot_bytes: Count
    num_slots: Count
    quarantine_ms: Annotated[int, Field(strict=True, ge=0)] = DEFAULT_QUARANTINE_MS
    default_lease_ms: Count = 10000


@dataclass(frozen=True)
class Reservation:
    """A snapshot of one receiver-side reservation.

    Entry ``i`` describes ``keys[i]``: the slot the sender writes into (or,
    when ``already_present[i]``, the slot already holding the key, with a ref
    held) and the slot's generation, which the sender echoes back in
    ``ChunkStore.fill``. After a fill that lost a dedup race, ``slots[i]`` and
    ``generations[i]`` name the winning slot: ask ``ChunkStore.reservation``
    again before reading.
    """

    request_id: str
    keys: tuple[bytes, ...]
    slots: tuple[int, ...]
    generations: tuple[int, ...]
    already_present: tuple[bool, ...]
    expires_at: float
    nbytes: tuple[int, ...] = ()  # the bytes reserved for each key (what its checksum covers)


class ChunkDigest(NamedTuple):
    """What verifies a present chunk at use: its checksum over its first ``nbytes``."""

    checksum: int
    nbytes: int


@dataclass(frozen=True)
class StoreStats:
    """Slot counts by state (they sum to ``num_slots``) and lifetime counters.

    ``hits``/``misses`` count keys passed to ``lookup``: found, or not found
    (every key after the first miss is a miss). ``evictions`` counts FILLED
    slots dropped from the LRU to make room.
    """

    free: int
    reserved: int
    filled: int
    pinned: int
    quarantined: int
    hits: int
    misses: int
    evictions: int
    checksum_failures: int
    expired_reservations: int
    cancelled_reservations: int
