"""TieredStore: prompt lookups, holds, write-behind to disk, pin and clear."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from fabric.errors import ConfigError
from fabric.store import ChunkStore, DiskTier, StoreConfig
from fabric.store.tier import TieredStore

CT = 8
TOKENS = list(range(50, 50 + 4 * CT + 3))  # 4 full chunks + 3 tokens


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def fill(tier: TieredStore, tokens: list[int], count: int, value: int = 1) -> None:
    for i, key in enumerate(tier.keys(tokens)[:count]):
        slot = tier.store.allocate(key)
        tier.store.pool.slot_view(slot)[:128].fill_(value + i)
        tier.store.commit(slot, key, 128)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def tier(tmp_path: Path, clock: Clock) -> Iterator[TieredStore]:
    store = ChunkStore(StoreConfig(slot_bytes=256, num_slots=6))
    t = TieredStore(
        store, chunk_tokens=CT, fingerprint="fp", disk=DiskTier(tmp_path, 1 << 20), clock=clock
    )
    yield t
    t.close()


def test_keys_cover_full_chunks_only(tier: TieredStore) -> None:
    assert len(tier.keys(TOKENS)) == 4
    assert tier.keys(TOKENS)[:2] == tier.keys(TOKENS[: 2 * CT])


def test_lookup_counts_the_leading_run(tier: TieredStore) -> None:
    fill(tier, TOKENS, 2)
    hit = tier.lookup(TOKENS)
    assert (hit.chunks, hit.disk, hit.slots) == (2, 0, ())
    assert tier.lookup(list(range(999, 999 + 3 * CT))).chunks == 0


def test_hold_pins_slots_until_taken_or_expired(tier: TieredStore, clock: Clock) -> None:
    fill(tier, TOKENS, 3)
    hit = tier.lookup(TOKENS, hold="r1", lease_ms=1000)
    assert hit.chunks == 3 and len(hit.slots) == 3 and tier.held_count() == 1
    assert tier.store.stats().filled == 3
    slots = tier.take_hold("r1")
    assert slots == list(hit.slots) and tier.take_hold("r1") is None
    tier.store.release_slots(slots)
    tier.lookup(TOKENS, hold="r2", lease_ms=1000)
    clock.now += 0.5
    assert tier.expire_holds() == 0
    clock.now += 1.0
    assert tier.expire_holds() == 1 and tier.held_count() == 0
    assert tier.counters.holds_expired == 1


def test_a_second_hold_for_the_same_request_replaces_the_first(tier: TieredStore) -> None:
    fill(tier, TOKENS, 2)
    tier.lookup(TOKENS, hold="r1")
    tier.lookup(TOKENS, hold="r1")
    slots = tier.take_hold("r1")
    assert slots is not None
    tier.store.release_slots(slots)  # would raise if refs had been taken twice
    assert tier.flush(10)  # the disk writer holds a ref while it copies
    assert tier.store.drop_unused() == 2


def test_write_behind_then_read_back_after_memory_is_cleared(tier: TieredStore) -> None:
    fill(tier, TOKENS, 4, value=10)
    assert tier.flush(10)
    assert tier.disk is not None and tier.disk.stats().files == 4
    assert tier.clear("memory") == 4
    assert tier.lookup(TOKENS).chunks == 4 and tier.lookup(TOKENS).disk == 4
    hit = tier.lookup(TOKENS, hold="r1")
    assert (hit.chunks, hit.disk) == (4, 4)
    for i, slot in enumerate(hit.slots):
        assert int(tier.store.pool.slot_view(slot)[0]) == 10 + i
    assert tier.release_hold("r1")
    assert tier.counters.disk_hit_chunks >= 4


def test_a_chunk_evicted_before_its_write_is_skipped(tmp_path: Path) -> None:
    store = ChunkStore(StoreConfig(slot_bytes=256, num_slots=2))
    tier = TieredStore(store, chunk_tokens=CT, fingerprint="fp", disk=DiskTier(tmp_path, 1 << 20))
    try:
        fill(tier, TOKENS, 4)  # only 2 slots: the first two are evicted meanwhile, maybe
        assert tier.flush(10)
        written = tier.disk.stats().files  # type: ignore[union-attr]
        assert written + tier.counters.disk_skipped == 4
    finally:
        tier.close()


def test_pin_brings_chunks_in_from_disk(tier: TieredStore) -> None:
    fill(tier, TOKENS, 3)
    assert tier.flush(10)
    tier.clear("memory")
    assert tier.pin(TOKENS) == 3
    assert tier.store.stats().pinned == 3
    assert tier.pin(TOKENS, pin=False) == 3
    assert tier.store.stats().pinned == 0


def test_clear_disk_and_all(tier: TieredStore) -> None:
    fill(tier, TOKENS, 2)
    assert tier.flush(10)
    assert tier.clear("disk") == 2
    assert tier.lookup(TOKENS).chunks == 2  # still in memory
    assert tier.clear("all") == 2
    assert tier.lookup(TOKENS).chunks == 0
    with pytest.raises(ConfigError, match="tier"):
        tier.clear("ssd")


def test_memory_only_tier_has_no_writer(clock: Clock) -> None:
    store = ChunkStore(StoreConfig(slot_bytes=256, num_slots=4))
    tier = TieredStore(store, chunk_tokens=CT, fingerprint="fp", clock=clock)
    fill(tier, TOKENS, 2)
    assert store.on_present is None and tier.flush(0.1)
    assert tier.lookup(TOKENS, hold="r").chunks == 2
    tier.close()  # releases the hold
    assert store.drop_unused() == 2
