"""ChunkPool: one aligned region, slot views over the right bytes."""

from __future__ import annotations

import pytest

from fabric.errors import ConfigError
from fabric.store import ChunkPool
from fabric.store.pool import ALIGNMENT


@pytest.mark.parametrize(("num_slots", "slot_bytes"), [(1, 1), (3, 1000), (8, 4096), (5, 65537)])
def test_pool_is_one_aligned_region(num_slots: int, slot_bytes: int) -> None:
    pool = ChunkPool(num_slots, slot_bytes)
    assert pool.base_address % ALIGNMENT == 0
    assert pool.nbytes == num_slots * slot_bytes
    assert pool.buffer.numel() == pool.nbytes
    assert pool.buffer.dim() == 1 and str(pool.buffer.dtype) == "torch.uint8"
    assert pool.buffer.data_ptr() == pool.base_address
    assert pool.device == "cpu"


def test_slot_view_writes_only_its_slot() -> None:
    pool = ChunkPool(4, 100)
    pool.buffer.fill_(0)
    pool.slot_view(2).fill_(7)
    data = bytes(pool.buffer.numpy())
    assert data == bytes(200) + bytes([7]) * 100 + bytes(100)
    assert pool.slot_view(2).data_ptr() == pool.base_address + pool.slot_offset(2)
    assert pool.slot_offset(3) == 300


def test_memoryview_aliases_slot_view() -> None:
    pool = ChunkPool(3, 64)
    pool.memoryview(1, 5)[:] = b"hello"
    assert bytes(pool.slot_view(1)[:5].numpy()) == b"hello"
    assert len(pool.memoryview(1)) == 64
    assert len(pool.memoryview(1, 0)) == 0


@pytest.mark.parametrize("slot", [-1, 3, 100])
def test_slot_out_of_range(slot: int) -> None:
    pool = ChunkPool(3, 64)
    with pytest.raises(IndexError, match="out of range"):
        pool.slot_view(slot)
    with pytest.raises(IndexError, match="out of range"):
        pool.memoryview(slot, 1)


def test_memoryview_rejects_oversized_nbytes() -> None:
    with pytest.raises(ValueError, match="nbytes 65"):
        ChunkPool(3, 64).memoryview(0, 65)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"num_slots": 0, "slot_bytes": 64}, "num_slots"),
        ({"num_slots": 2, "slot_bytes": -1}, "slot_bytes"),
        ({"num_slots": 2, "slot_bytes": 64, "device": "cuda"}, "device"),
    ],
)
def test_bad_pool_arguments_name_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=f"^{field}:"):
        ChunkPool(**kwargs)  # type: ignore[arg-type]
