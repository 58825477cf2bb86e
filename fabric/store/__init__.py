"""Chunk store: a registered memory pool of fixed-size slots and its index.

- :mod:`fabric.store.pool`: :class:`ChunkPool`, the one region registered with
  the transport;
- :mod:`fabric.store.chunk_store`: :class:`ChunkStore`, chunk key -> slot, with
  reservations (leases) for remote writers, ref counts, pins and LRU eviction;
- :mod:`fabric.store.checksum`: :func:`checksum`, xxh3-64 over a slot's bytes;
- :mod:`fabric.store.disk`: :class:`DiskTier`, checksummed chunk files within a
  byte budget, LRU, rebuilt at start.
"""

from __future__ import annotations

from fabric.store.checksum import checksum
from fabric.store.chunk_store import ChunkStore
from fabric.store.disk import DiskStats, DiskTier
from fabric.store.pool import ChunkPool
from fabric.store.records import ChunkDigest, Reservation, SlotState, StoreConfig, StoreStats

__all__ = [
    "ChunkDigest",
    "ChunkPool",
    "ChunkStore",
    "DiskStats",
    "DiskTier",
    "Reservation",
    "SlotState",
    "StoreConfig",
    "StoreStats",
    "checksum",
]
