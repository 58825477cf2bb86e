"""A release that overtakes the lookup it answers leaves no hold behind.

With a disk tier a lookup that holds runs on a server thread while the
worker applies the scheduler's release of the same request in-process: the
release can come while the lookup still reads chunks in. Here a lookup's
disk read is parked on a gate, the release (or the tier's close) runs
meanwhile, and once the read finishes nothing is held and no slot stays
referenced.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from fabric.store import ChunkStore, DiskTier, StoreConfig
from fabric.store.tier import Hit, TieredStore

CT = 8
TOKENS = list(range(50, 50 + 3 * CT))  # 3 full chunks


@pytest.fixture
def tier(tmp_path: Path) -> Iterator[TieredStore]:
    store = ChunkStore(StoreConfig(slot_bytes=256, num_slots=8))
    t = TieredStore(store, chunk_tokens=CT, fingerprint="fp", disk=DiskTier(tmp_path, 1 << 20))
    yield t
    t.close()


def on_disk_only(tier: TieredStore) -> None:
    """TOKENS' chunks written behind to disk, then dropped from memory."""
    for i, k in enumerate(tier.keys(TOKENS)):
        slot = tier.store.allocate(k)
        tier.store.pool.slot_view(slot)[:128].fill_(i + 1)
        tier.store.commit(slot, k, 128)
    assert tier.flush()
    assert tier.store.drop_unused() == 3


class ParkedRead:
    """The tier's disk reads, the first one parked until ``gate`` opens."""

    def __init__(self, tier: TieredStore, monkeypatch: pytest.MonkeyPatch) -> None:
        assert tier.disk is not None
        self.real = tier.disk.read_into
        self.parked, self.gate = threading.Event(), threading.Event()
        monkeypatch.setattr(tier.disk, "read_into", self)

    def __call__(self, key: bytes, out: object) -> int | None:
        if not self.parked.is_set():
            self.parked.set()
            assert self.gate.wait(60), "the test never opened the gate"
        return self.real(key, out)


def referenced(tier: TieredStore) -> int:
    return tier.store.table_sizes()["store_referenced_slots"]


def lookup_in_thread(tier: TieredStore, rid: str) -> tuple[threading.Thread, list[Hit]]:
    hits: list[Hit] = []
    thread = threading.Thread(target=lambda: hits.append(tier.lookup(TOKENS, hold=rid)))
    thread.start()
    return thread, hits


def test_a_release_during_the_lookups_disk_read_leaves_no_hold(
    tier: TieredStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    on_disk_only(tier)
    read = ParkedRead(tier, monkeypatch)
    lookup, hits = lookup_in_thread(tier, "r")
    try:
        assert read.parked.wait(30), "the lookup never read from disk"
        assert not tier.release_hold("r")  # nothing held yet: the lookup still reads
    finally:
        read.gate.set()
        lookup.join(30)
    [hit] = hits
    assert (hit.chunks, hit.slots) == (3, ())  # answered, but nothing held
    assert tier.take_held("r") is None and tier.held_count() == 0
    assert referenced(tier) == 0
    sizes = tier.table_sizes()
    assert sizes["tier_holds"] == 0 and sizes.get("tier_lookups") == 0
    assert tier.counters.holds_cancelled == 1
    # The chunks were read in and stay usable: the next lookup holds them.
    assert tier.lookup(TOKENS, hold="r2").slots
    assert tier.release_hold("r2") and referenced(tier) == 0


def test_a_release_before_the_lookup_began_does_not_cancel_it(tier: TieredStore) -> None:
    """Releases of requests with no lookup running leave nothing behind and
    do not touch a later lookup of the same id."""
    on_disk_only(tier)
    for i in range(1000):
        assert not tier.release_hold(f"gone-{i}")
    assert not tier.release_hold("r")
    assert tier.table_sizes()["tier_lookups"] == 0
    hit = tier.lookup(TOKENS, hold="r")
    assert len(hit.slots) == 3 and tier.held_count() == 1
    assert tier.release_hold("r") and referenced(tier) == 0


def test_a_lookup_that_ends_after_close_keeps_nothing(
    tier: TieredStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    on_disk_only(tier)
    read = ParkedRead(tier, monkeypatch)
    lookup, hits = lookup_in_thread(tier, "r")
    try:
        assert read.parked.wait(30), "the lookup never read from disk"
        tier.close()
    finally:
        read.gate.set()
        lookup.join(30)
    assert hits and hits[0].slots == ()
    assert tier.held_count() == 0 and referenced(tier) == 0
