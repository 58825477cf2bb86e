"""Per-request state of the store, the tier and the disk tier: always given back.

Refs taken for a request go back on every error path (a disk read that
raises, two holds of one request id), the store's gauges say so, and a
disk Clear never holds the disk tier's lock while it unlinks.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from fabric.store import ChunkStore, DiskTier, StoreConfig
from fabric.store.checksum import checksum
from fabric.store.tier import Hit, TieredStore

from ._helpers import key, push, put

CT = 8
TOKENS = list(range(50, 50 + 4 * CT))  # 4 full chunks


@pytest.fixture
def tier(tmp_path: Path) -> Iterator[TieredStore]:
    store = ChunkStore(StoreConfig(slot_bytes=256, num_slots=8))
    t = TieredStore(store, chunk_tokens=CT, fingerprint="fp", disk=DiskTier(tmp_path, 1 << 20))
    yield t
    t.close()


def save(tier: TieredStore, count: int) -> None:
    """``count`` leading chunks of TOKENS, in memory and (written behind) on disk."""
    for i, k in enumerate(tier.keys(TOKENS)[:count]):
        slot = tier.store.allocate(k)
        tier.store.pool.slot_view(slot)[:128].fill_(i + 1)
        tier.store.commit(slot, k, 128)
    assert tier.flush()


def held(store: ChunkStore) -> tuple[int, int]:
    """(slots reserved, slots referenced), from the store's gauges."""
    sizes = store.table_sizes()
    return sizes["store_reserved_slots"], sizes["store_referenced_slots"]


def test_referenced_slots_follow_every_ref(store: ChunkStore) -> None:
    put(store, 1)
    put(store, 2)
    assert held(store) == (0, 0)
    slots = store.acquire([key(1), key(2)])
    store.acquire([key(1)])
    assert held(store) == (0, 2)
    store.release_slots(slots)
    assert held(store) == (0, 1)
    store.release_slots(slots[:1])
    push(store, "r1", [1, 3])  # one present (ref), one filled (ref)
    assert held(store) == (0, 2) and store.table_sizes()["store_leases"] == 1
    store.release("r1")
    assert held(store) == (0, 0) and store.table_sizes()["store_leases"] == 0
    store.reserve("r2", [key(4)], [64])
    assert held(store) == (1, 0)
    store.cancel("r2")
    assert held(store) == (0, 0)


def test_two_holds_of_one_request_leave_no_ref_behind(tier: TieredStore) -> None:
    """A lookup that holds for a request id another lookup is holding for
    (the scheduler's and the proxy's, racing on the offload threads) must
    give the refs of the hold it replaces back."""
    save(tier, 2)
    real_acquire, nested = tier._acquire, []  # type: ignore[var-annotated]

    def acquire_racing(keys: list[bytes]) -> Hit:
        hit = real_acquire(keys)
        if not nested:  # the other lookup of "r" lands while this one reads
            nested.append(None)
            nested[0] = tier.lookup(TOKENS, hold="r")
        return hit

    tier._acquire = acquire_racing  # type: ignore[method-assign]
    assert tier.lookup(TOKENS, hold="r").chunks == 2
    assert nested[0].chunks == 2 and held(tier.store) == (0, 2)
    assert tier.release_hold("r")
    assert held(tier.store) == (0, 0)
    assert tier.table_sizes()["tier_holds"] == 0


def test_a_disk_read_that_raises_gives_every_slot_back(
    tier: TieredStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    save(tier, 3)
    keys = tier.keys(TOKENS)
    tier.store.discard(keys[1])
    tier.store.discard(keys[2])  # chunk 0 in memory, 1 and 2 on disk only
    assert tier.disk is not None
    real_read, calls = tier.disk.read_into, []

    def read_failing_second(k: bytes, out: object) -> int | None:
        calls.append(k)
        if len(calls) == 2:
            raise RuntimeError("injected disk fault")
        return real_read(k, out)

    monkeypatch.setattr(tier.disk, "read_into", read_failing_second)
    with pytest.raises(RuntimeError, match="injected"):
        tier.lookup(TOKENS, hold="r")
    assert held(tier.store) == (0, 0)  # chunk 0's ref, chunk 1's read-in, chunk 2's slot
    assert tier.table_sizes()["tier_holds"] == 0
    monkeypatch.undo()
    assert tier.lookup(TOKENS, hold="r2").chunks == 3  # nothing was lost either
    tier.release_hold("r2")
    assert held(tier.store) == (0, 0)


def test_a_disk_clear_unlinks_outside_the_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a Clear unlinks (parked here on its first file), the disk tier
    answers, another key is put, and a put of a key being cleared waits for
    its unlink, then lands and stays."""
    disk = DiskTier(tmp_path, 1 << 20)
    data = bytes(64)
    for i in range(50):
        assert disk.put(key(i), data, checksum(data))
    started, gate = threading.Event(), threading.Event()
    real_unlink = Path.unlink

    def parked_unlink(path: Path, missing_ok: bool = False) -> None:
        if path.suffix == ".chunk":
            started.set()
            assert gate.wait(60)
        real_unlink(path, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", parked_unlink)
    cleared: list[int] = []
    clear = threading.Thread(target=lambda: cleared.append(disk.clear()), daemon=True)
    clear.start()
    try:
        assert started.wait(30)
        answers: list[object] = []

        def ask() -> None:
            answers.append(disk.stats().files)
            answers.append(disk.contains(key(0)))
            answers.append(disk.put(key(100), data, checksum(data)))

        asker = threading.Thread(target=ask, daemon=True)
        asker.start()
        asker.join(30)  # NOTE: a hang guard: the Clear stays parked until the gate opens
        assert answers == [0, False, True]
        assert disk.table_sizes()["disk_writers"] == 50  # each cleared key held until unlinked
        slot, waiting = disk._writers[key(7)], threading.Event()
        real_wait = slot.wait

        def wait(timeout: float | None = None) -> bool:
            waiting.set()
            return real_wait(timeout)

        slot.wait = wait  # type: ignore[method-assign]
        rewrite = threading.Thread(
            target=lambda: answers.append(disk.put(key(7), data, checksum(data)))
        )
        rewrite.start()
        # The put of key 7 reached the wait for its unlink, and is still in it.
        assert waiting.wait(30), "the put of a key being cleared did not wait for its unlink"
        assert not cleared and len(answers) == 3 and rewrite.is_alive()
    finally:
        gate.set()
        clear.join(30)
    rewrite.join(30)
    assert cleared == [50] and answers[-1] is True
    assert disk.contains(key(7)) and disk.contains(key(100))  # the put after the unlink stays
    assert disk.stats().files == 2 and disk.table_sizes()["disk_writers"] == 0
    assert sorted(p.name for p in tmp_path.glob("*/*.chunk")) == sorted(
        f"{key(i).hex()}.chunk" for i in (7, 100)
    )
