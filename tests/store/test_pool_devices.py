"""ChunkPool on pinned host memory and VRAM: device names, checksums where the
bytes live, and the disk tier staging a VRAM chunk through host memory.

This machine has no GPU, so "VRAM" here is host memory behind a pool that
believes it is on ``cuda:0`` (``fabric.testing.host_vram``): every branch a VRAM pool takes
(no memoryview, fold64 instead of xxh3, staging copies) runs for real; only
the allocation is faked. benchmarks/gpu_check.sh runs the same paths on a GPU.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from fabric.errors import ChecksumMismatch, ConfigError
from fabric.kv.fold64 import fold64_reference
from fabric.store import ChunkPool, ChunkStore, DiskTier, StoreConfig, checksum
from fabric.store import pool as pool_mod
from fabric.store.pool import check_device, resolve_pool_device
from fabric.store.tier import TieredStore
from fabric.testing.host_vram import host_backed_vram

from ._helpers import key, payload

SLOT = 256


@pytest.fixture
def fake_vram(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Pools on any device get host memory; the ``pinned`` flag of every
    staging buffer asked for."""
    return host_backed_vram(monkeypatch)


@pytest.mark.parametrize("device", ["cpu", "pinned", "cuda", "cuda:0", "cuda:3"])
def test_device_names(device: str) -> None:
    assert check_device(device) == device


@pytest.mark.parametrize("device", ["", "gpu", "cuda:", "cuda:x", "CPU", "cuda:0:1", "meta"])
def test_bad_device_names_the_field(device: str) -> None:
    with pytest.raises(ConfigError, match=r"^device: .* not a pool device"):
        ChunkPool(2, SLOT, device=device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this torch sees a CUDA device")
@pytest.mark.parametrize("device", ["pinned", "cuda", "cuda:1"])
def test_gpu_memory_without_cuda_is_a_clear_error(device: str) -> None:
    with pytest.raises(ConfigError, match=r"^device: .* needs a CUDA device.*use device 'cpu'"):
        ChunkPool(2, SLOT, device=device)


def test_host_pool_hashes_with_xxh3() -> None:
    pool = ChunkPool(2, SLOT)
    assert (pool.is_host, pool.memory_kind, pool.checksum_name) == (True, "DRAM", "xxh3")
    pool.memoryview(1, 100)[:] = payload(1, 100)
    assert pool.checksum(1, 100) == checksum(payload(1, 100))
    assert pool.staging_buffer().numel() == SLOT


def test_vram_pool_hashes_with_fold64_on_its_own_memory(fake_vram: list[bool]) -> None:
    pool = ChunkPool(3, SLOT, device="cuda:0")
    assert (pool.is_host, pool.memory_kind, pool.checksum_name) == (False, "VRAM", "fold64")
    assert pool.base_address % pool_mod.ALIGNMENT == 0
    data = payload(7, 201)  # not a whole number of words
    pool.slot_view(2)[:201].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    assert pool.checksum(2, 201) == fold64_reference(data) != checksum(data)
    with pytest.raises(ValueError, match="nbytes"):
        pool.checksum(2, SLOT + 1)
    with pytest.raises(ValueError, match="memoryview: the pool is in cuda:0 memory"):
        pool.memoryview(0)
    assert pool.staging_buffer().numel() == SLOT and fake_vram == [True]


def _write(pool: ChunkPool, slot: int, data: bytes) -> None:
    pool.slot_view(slot)[: len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))


def test_store_on_vram_verifies_fills_with_fold64(fake_vram: list[bool]) -> None:
    config = StoreConfig(slot_bytes=SLOT, num_slots=4)
    store = ChunkStore(config, ChunkPool(4, SLOT, device="cuda"))
    res = store.reserve("r", [key(1), key(2)], [SLOT, SLOT])
    _write(store.pool, res.slots[0], payload(1))
    store.fill("r", 0, fold64_reference(payload(1)), res.generations[0])
    _write(store.pool, res.slots[1], payload(2))
    # NOTE: the sender's xxh3 is not what a VRAM pool checks: refused, not taken
    with pytest.raises(ChecksumMismatch):
        store.fill("r", 1, checksum(payload(2)), res.generations[1])
    assert store.stats().checksum_failures == 1
    store.release("r")
    assert store.lookup([key(1), key(2)]) == 1
    slot = store.allocate(key(3))
    _write(store.pool, slot, payload(3))
    assert store.commit(slot, key(3), SLOT) == fold64_reference(payload(3))


@pytest.fixture
def vram_tier(fake_vram: list[bool], tmp_path: Path) -> Iterator[TieredStore]:
    store = ChunkStore(StoreConfig(slot_bytes=SLOT, num_slots=6), ChunkPool(6, SLOT, device="cuda"))
    tier = TieredStore(store, chunk_tokens=8, fingerprint="fp", disk=DiskTier(tmp_path, 1 << 20))
    yield tier
    tier.close()


def test_disk_tier_stages_vram_chunks_through_pinned_memory(
    vram_tier: TieredStore, fake_vram: list[bool]
) -> None:
    tokens = list(range(100, 100 + 3 * 8))
    keys = vram_tier.keys(tokens)
    for i, k in enumerate(keys):
        slot = vram_tier.store.allocate(k)
        _write(vram_tier.store.pool, slot, payload(i, 200))
        vram_tier.store.commit(slot, k, 200)
    assert vram_tier.flush(10)
    disk = vram_tier.disk
    assert disk is not None and disk.stats().files == 3
    assert fake_vram and all(fake_vram)  # every staging buffer was pinned
    assert vram_tier.clear("memory") == 3
    hit = vram_tier.lookup(tokens, hold="r1")
    # NOTE: read back verified by the disk (xxh3 of the staged bytes), copied
    # up, and committed under the pool's fold64
    assert (hit.chunks, hit.disk) == (3, 3)
    for i, slot in enumerate(hit.slots):
        assert bytes(vram_tier.store.pool.slot_view(slot)[:200].tolist()) == payload(i, 200)
        assert vram_tier.store.slot_checksum(slot) == fold64_reference(payload(i, 200))
    assert (disk.stats().corrupt, disk.stats().hits) == (0, 3)
    assert vram_tier.release_hold("r1")


@pytest.mark.parametrize(
    ("requested", "caches", "host_only", "expected"),
    [
        ("auto", {"cuda:1"}, None, "cuda:1"),  # VRAM on the cache's own GPU
        ("auto", {"cuda:0"}, "the tcp transport moves host memory only", "pinned"),
        ("auto", {"cpu"}, None, "cpu"),
        ("auto", {"cpu"}, "whatever", "cpu"),
        ("cuda", {"cuda:0"}, None, "cuda:0"),
        ("pinned", {"cuda:0"}, None, "pinned"),
        ("cpu", {"cuda:0"}, None, "cpu"),
        ("auto", {"cuda:0", "cuda:1"}, None, "cpu"),  # no one GPU to put it on
        ("host", {"cuda:0"}, None, "pinned"),
        ("host", {"cpu"}, None, "cpu"),
    ],
)
def test_pool_device_resolution(
    requested: str, caches: set[str], host_only: str | None, expected: str
) -> None:
    assert resolve_pool_device(requested, caches, host_only) == expected


@pytest.mark.parametrize(
    ("requested", "caches", "host_only", "message"),
    [
        ("cuda", {"cpu"}, None, "pool_device: 'cuda' needs the KV cache on one GPU; it is on cpu"),
        ("cuda", {"cuda:0"}, "the shared store", "pool_device: 'cuda' is not possible here: the"),
        (
            "vram",
            {"cuda:0"},
            None,
            "pool_device: 'vram' is not one of auto, host, cuda, pinned or cpu",
        ),
    ],
)
def test_pool_device_that_cannot_be_had_names_the_field(
    requested: str, caches: set[str], host_only: str | None, message: str
) -> None:
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}"):
        resolve_pool_device(requested, caches, host_only)


def test_a_vram_chunk_changed_in_its_slot_is_not_saved_to_disk(vram_tier: TieredStore) -> None:
    """A host pool's file carries the checksum the chunk was committed under,
    so a slot changed since fails when read back; a VRAM chunk's file gets
    xxh3 of the staged bytes, so the slot is checked against its fold64 first."""
    tokens = list(range(200, 200 + 8))
    (key,) = vram_tier.keys(tokens)
    slot = vram_tier.store.allocate(key)
    _write(vram_tier.store.pool, slot, payload(5, 200))
    write_behind, vram_tier.store.on_present = vram_tier.store.on_present, None
    vram_tier.store.commit(slot, key, 200)
    vram_tier.store.pool.slot_view(slot)[7] ^= 0x40  # after the commit, before the write-behind
    assert write_behind is not None
    write_behind(key)
    assert vram_tier.flush(10)
    disk = vram_tier.disk
    assert disk is not None and disk.stats().files == 0
    assert vram_tier.counters.disk_skipped == 1


def test_a_hash_that_fails_gives_the_slot_back(
    fake_vram: list[bool], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A VRAM pool's hash is a kernel launch, which can fail: commit frees the
    allocation it was committing (the slot would stay reserved for good)."""
    store = ChunkStore(StoreConfig(slot_bytes=SLOT, num_slots=2), ChunkPool(2, SLOT, device="cuda"))

    def broken(slot: int, nbytes: int) -> int:
        raise RuntimeError("fabric fold64 launch failed: out of memory")

    slot = store.allocate(key(1))
    monkeypatch.setattr(store.pool, "checksum", broken)
    with pytest.raises(RuntimeError, match="launch failed"):
        store.commit(slot, key(1), SLOT)
    assert store.stats().free == 2 and store.reserved_count() == 0
