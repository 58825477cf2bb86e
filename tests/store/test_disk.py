"""DiskTier: atomic checksummed chunk files, LRU within a byte budget, rebuilt at start."""

from __future__ import annotations

import os
import random
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from fabric.errors import ConfigError, StoreError
from fabric.store import DiskStats, DiskTier, checksum
from fabric.store.disk import HEADER_BYTES

from ._helpers import FakeClock, key, payload

NBYTES = 1000
FILE_BYTES = HEADER_BYTES + NBYTES

DiskFactory = Callable[..., DiskTier]


@pytest.fixture
def make_disk(tmp_path: Path, clock: FakeClock) -> DiskFactory:
    """A DiskTier on ``tmp_path/disk`` and the fake clock; each call is a "restart"."""

    def make(budget_bytes: int = 3 * FILE_BYTES, **kwargs: object) -> DiskTier:
        return DiskTier(tmp_path / "disk", budget_bytes, clock=clock, **kwargs)  # type: ignore[arg-type]

    return make


@pytest.fixture
def disk(make_disk: DiskFactory) -> DiskTier:
    return make_disk()


def put(disk: DiskTier, i: int, nbytes: int = NBYTES) -> bool:
    data = payload(i, nbytes)
    return disk.put(key(i), data, checksum(data))


def read(disk: DiskTier, i: int) -> bytes | None:
    out = bytearray(NBYTES)
    n = disk.read_into(key(i), out)
    return None if n is None else bytes(out[:n])


def chunk_path(disk: DiskTier, i: int) -> Path:
    name = key(i).hex()
    return disk.root / name[:2] / f"{name}.chunk"


def files_on_disk(disk: DiskTier) -> list[Path]:
    return sorted(p for p in disk.root.rglob("*") if p.is_file())


def flip_byte(path: Path, offset: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0xFF
    path.write_bytes(raw)


# --- round trips


@pytest.mark.parametrize(
    "make_data",
    [
        lambda raw: raw,
        lambda raw: memoryview(bytearray(raw)),
        lambda raw: np.frombuffer(raw, dtype=np.uint8),
        lambda raw: np.frombuffer(raw, dtype=np.float32).reshape(10, -1),
        lambda raw: torch.frombuffer(bytearray(raw), dtype=torch.uint8),
        lambda raw: torch.frombuffer(bytearray(raw), dtype=torch.bfloat16).view(4, -1),
    ],
    ids=["bytes", "memoryview", "numpy-u8", "numpy-f32-2d", "torch-u8", "torch-bf16-2d"],
)
def test_put_read_roundtrip(disk: DiskTier, make_data: Callable[[bytes], object]) -> None:
    raw = payload(7, NBYTES)
    assert disk.put(key(7), make_data(raw), checksum(raw))
    assert disk.contains(key(7)) and disk.nbytes(key(7)) == NBYTES
    into_bytes, into_numpy = bytearray(NBYTES + 24), np.zeros(NBYTES, np.uint8)
    into_torch = torch.zeros(NBYTES + 1, dtype=torch.uint8)
    for out in (into_bytes, into_numpy, into_torch):
        assert disk.read_into(key(7), out) == NBYTES
    assert into_bytes[:NBYTES] == raw
    assert into_numpy.tobytes() == raw
    assert into_torch[:NBYTES].numpy().tobytes() == raw
    s = disk.stats()
    assert (s.files, s.bytes, s.writes, s.hits, s.misses) == (1, FILE_BYTES, 1, 3, 0)
    assert chunk_path(disk, 7).stat().st_size == FILE_BYTES


def test_absent_key_is_a_miss(disk: DiskTier) -> None:
    assert read(disk, 1) is None
    assert disk.nbytes(key(1)) is None and not disk.contains(key(1))
    assert disk.stats().misses == 1


def test_put_dedups_and_marks_used(disk: DiskTier, clock: FakeClock) -> None:
    put(disk, 0)
    clock.now += 1
    put(disk, 1)
    clock.now += 1
    mtime = chunk_path(disk, 0).stat().st_mtime_ns
    assert put(disk, 0)
    assert disk.stats().writes == 2
    assert disk.keys() == [key(1), key(0)]
    assert chunk_path(disk, 0).stat().st_mtime_ns > mtime


def test_fsync_roundtrip(make_disk: DiskFactory) -> None:
    disk = make_disk(fsync=True)
    assert put(disk, 3)
    assert read(disk, 3) == payload(3, NBYTES)


# --- budget and LRU


def test_lru_eviction_by_budget(disk: DiskTier, clock: FakeClock) -> None:
    for i in range(3):
        put(disk, i)
        clock.now += 1
    assert read(disk, 0) is not None  # 0 becomes the youngest
    put(disk, 3)
    assert disk.keys() == [key(2), key(0), key(3)]
    assert not chunk_path(disk, 1).exists()
    s = disk.stats()
    assert (s.files, s.bytes, s.evictions) == (3, 3 * FILE_BYTES, 1)


def test_larger_chunk_evicts_several(disk: DiskTier) -> None:
    for i in range(3):
        put(disk, i)
    assert put(disk, 9, nbytes=2 * NBYTES)
    assert disk.keys() == [key(2), key(9)]
    assert disk.stats().evictions == 2


def test_chunk_bigger_than_budget_is_refused(disk: DiskTier) -> None:
    put(disk, 0)
    assert not put(disk, 1, nbytes=3 * FILE_BYTES)
    assert disk.keys() == [key(0)]
    s = disk.stats()
    assert (s.writes, s.write_failures, s.evictions) == (1, 0, 0)


def test_leading_present(disk: DiskTier) -> None:
    put(disk, 0)
    put(disk, 1)
    put(disk, 3)
    assert disk.leading_present([key(0), key(1), key(2), key(3)]) == 2
    assert disk.leading_present([key(2), key(0)]) == 0
    assert disk.leading_present([]) == 0


def test_remove_and_clear(disk: DiskTier) -> None:
    for i in range(3):
        put(disk, i)
    assert disk.remove(key(1)) and not disk.remove(key(1))
    assert not chunk_path(disk, 1).exists()
    assert disk.clear() == 2
    assert files_on_disk(disk) == []
    s = disk.stats()
    assert (s.files, s.bytes, s.evictions) == (0, 0, 0)


# --- restarts


def test_restart_rebuilds_keys_order_and_bytes(make_disk: DiskFactory, clock: FakeClock) -> None:
    disk = make_disk()
    for i in range(3):
        put(disk, i)
        clock.now += 1
    assert read(disk, 0) is not None
    disk.close()
    again = make_disk()
    assert again.keys() == [key(1), key(2), key(0)]
    assert again.stats() == DiskStats(
        files=3,
        bytes=3 * FILE_BYTES,
        budget_bytes=3 * FILE_BYTES,
        hits=0,
        misses=0,
        writes=0,
        write_failures=0,
        evictions=0,
        corrupt=0,
    )
    assert all(read(again, i) == payload(i, NBYTES) for i in range(3))


def test_restart_with_smaller_budget_evicts_oldest(
    make_disk: DiskFactory, clock: FakeClock
) -> None:
    disk = make_disk()
    for i in range(3):
        put(disk, i)
        clock.now += 1
    again = make_disk(budget_bytes=FILE_BYTES)
    assert again.keys() == [key(2)]
    assert again.stats().evictions == 2
    assert [p.name for p in files_on_disk(again)] == [chunk_path(again, 2).name]


def test_leftover_temp_files_are_removed_at_start(make_disk: DiskFactory) -> None:
    disk = make_disk()
    put(disk, 0)
    (disk.root / ".tmp-123-abcdef").write_bytes(b"half a chunk")
    (disk.root / "notes.txt").write_text("not ours")
    again = make_disk()
    assert not (disk.root / ".tmp-123-abcdef").exists()
    assert (disk.root / "notes.txt").exists()
    assert again.keys() == [key(0)]


@pytest.mark.parametrize(
    "offset",
    [0, 4, 6, 8, 24, 32, 40],
    ids=["magic", "version", "flags", "key", "nbytes", "sum", "hdr-sum"],
)
def test_bad_header_is_dropped_at_start(make_disk: DiskFactory, offset: int) -> None:
    disk = make_disk()
    put(disk, 0)
    put(disk, 1)
    flip_byte(chunk_path(disk, 0), offset)
    again = make_disk()
    assert again.keys() == [key(1)]
    assert again.stats().corrupt == 1
    assert not chunk_path(again, 0).exists()


@pytest.mark.parametrize("change", ["truncate", "append", "header-only", "empty"])
def test_wrong_size_is_dropped_at_start(make_disk: DiskFactory, change: str) -> None:
    disk = make_disk()
    put(disk, 0)
    path = chunk_path(disk, 0)
    raw = path.read_bytes()
    sizes = {"truncate": len(raw) - 1, "header-only": HEADER_BYTES, "empty": 0}
    path.write_bytes(raw + b"x" if change == "append" else raw[: sizes[change]])
    again = make_disk()
    assert again.keys() == []
    assert again.stats().corrupt == 1
    assert not path.exists()


def test_file_under_another_key_name_is_dropped(make_disk: DiskFactory) -> None:
    disk = make_disk()
    put(disk, 0)
    target = chunk_path(disk, 1)
    target.parent.mkdir(exist_ok=True)
    chunk_path(disk, 0).rename(target)
    again = make_disk()
    assert again.keys() == [] and again.stats().corrupt == 1
    assert not target.exists()


# --- corruption found on read


@pytest.mark.parametrize(
    "offset", [HEADER_BYTES, HEADER_BYTES + NBYTES - 1, 10], ids=["first", "last", "header"]
)
def test_corrupt_file_is_never_returned(disk: DiskTier, offset: int) -> None:
    put(disk, 0)
    flip_byte(chunk_path(disk, 0), offset)
    assert read(disk, 0) is None
    s = disk.stats()
    assert (s.corrupt, s.misses, s.hits, s.files, s.bytes) == (1, 1, 0, 0, 0)
    assert not chunk_path(disk, 0).exists()
    assert put(disk, 0) and read(disk, 0) == payload(0, NBYTES)


def test_truncated_file_on_read(disk: DiskTier) -> None:
    put(disk, 0)
    path = chunk_path(disk, 0)
    path.write_bytes(path.read_bytes()[:-10])
    assert read(disk, 0) is None
    assert disk.stats().corrupt == 1 and not path.exists()


def test_vanished_file_is_a_miss_not_corruption(disk: DiskTier) -> None:
    put(disk, 0)
    chunk_path(disk, 0).unlink()
    assert read(disk, 0) is None
    s = disk.stats()
    assert (s.corrupt, s.misses, s.files, s.bytes) == (0, 1, 0, 0)


def test_read_into_checks_the_buffer(disk: DiskTier) -> None:
    put(disk, 0)
    with pytest.raises(ValueError, match="holds"):
        disk.read_into(key(0), bytearray(NBYTES - 1))
    with pytest.raises(ValueError, match="writable"):
        disk.read_into(key(0), bytes(NBYTES))
    with pytest.raises(ValueError, match="contiguous"):
        disk.read_into(key(0), np.zeros(2 * NBYTES, np.uint8)[::2])


# --- failures and misuse


def test_write_failure_is_counted_and_cleaned_up(
    disk: DiskTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", refuse)
    assert not put(disk, 0)
    monkeypatch.undo()
    s = disk.stats()
    assert (s.write_failures, s.writes, s.files, s.bytes) == (1, 0, 0, 0)
    assert files_on_disk(disk) == []
    assert put(disk, 0) and read(disk, 0) == payload(0, NBYTES)


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_read_only_directory(disk: DiskTier, tmp_path: Path) -> None:
    disk.root.chmod(0o500)
    try:
        assert not put(disk, 0)
        assert disk.stats().write_failures == 1
        with pytest.raises(ConfigError, match="path"):
            DiskTier(disk.root, FILE_BYTES)
    finally:
        disk.root.chmod(0o700)


@pytest.mark.parametrize("budget", [0, -1, 1.5, True])
def test_bad_budget(tmp_path: Path, budget: object) -> None:
    with pytest.raises(ConfigError, match="budget_bytes"):
        DiskTier(tmp_path, budget)  # type: ignore[arg-type]


def test_path_that_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    with pytest.raises(ConfigError, match="path"):
        DiskTier(tmp_path / "f", FILE_BYTES)
    with pytest.raises(ConfigError, match="path"):
        DiskTier(tmp_path / "f" / "sub", FILE_BYTES)


@pytest.mark.parametrize("bad", [b"", bytes(15), bytes(17), "0" * 16, bytearray(16)])
def test_bad_key(disk: DiskTier, bad: object) -> None:
    for call in (
        lambda: disk.put(bad, b"x", checksum(b"x")),  # type: ignore[arg-type]
        lambda: disk.read_into(bad, bytearray(8)),  # type: ignore[arg-type]
        lambda: disk.contains(bad),  # type: ignore[arg-type]
        lambda: disk.leading_present([bad]),  # type: ignore[list-item]
    ):
        with pytest.raises(ValueError, match="16 bytes"):
            call()


def test_keys_cannot_escape_the_directory(disk: DiskTier, tmp_path: Path) -> None:
    sneaky = [b"../../etc/passwd", b"/" * 16, b"\x00" * 16, b"..\\x\x00\xff.chunk".ljust(16, b"/")]
    for k in sneaky:
        assert disk.put(k, b"data", checksum(b"data"))
    names = {p.relative_to(disk.root).as_posix() for p in files_on_disk(disk)}
    assert names == {f"{k.hex()[:2]}/{k.hex()}.chunk" for k in sneaky}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["disk"]


def test_close_is_idempotent(disk: DiskTier) -> None:
    put(disk, 0)
    disk.close()
    disk.close()
    with pytest.raises(StoreError, match="closed"):
        put(disk, 1)
    with pytest.raises(StoreError, match="closed"):
        read(disk, 0)
    assert disk.stats().files == 1


# --- threads


def test_concurrent_puts_of_one_key_leave_one_file(make_disk: DiskFactory) -> None:
    disk = make_disk(budget_bytes=1 << 20)
    data = np.random.default_rng(0).integers(0, 256, 256 << 10, dtype=np.uint8)
    value = checksum(data)
    barrier = threading.Barrier(8)
    results: list[bool] = []

    def run() -> None:
        barrier.wait()
        results.append(disk.put(key(5), data, value))

    threads = [threading.Thread(target=run) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [True] * 8
    assert disk.stats().writes == 1
    assert files_on_disk(disk) == [chunk_path(disk, 5)]
    out = np.zeros_like(data)
    assert disk.read_into(key(5), out) == data.nbytes and np.array_equal(out, data)


def test_concurrent_puts_and_reads_stay_consistent(make_disk: DiskFactory) -> None:
    chunk = 16 << 10
    disk = make_disk(budget_bytes=10 * (HEADER_BYTES + chunk))
    chunks = {i: np.full(chunk, i, dtype=np.uint8) for i in range(24)}
    errors: list[str] = []

    def run(seed: int) -> None:
        rng = random.Random(seed)
        out = np.empty(chunk, np.uint8)
        for _ in range(150):
            i = rng.randrange(len(chunks))
            if rng.random() < 0.5:
                disk.put(key(i), chunks[i], checksum(chunks[i]))
            elif disk.read_into(key(i), out) is not None and not np.array_equal(out, chunks[i]):
                errors.append(f"chunk {i} read back wrong")

    threads = [threading.Thread(target=run, args=(seed,)) for seed in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    s = disk.stats()
    on_disk = files_on_disk(disk)
    assert s.write_failures == 0 and s.corrupt == 0
    assert s.bytes <= s.budget_bytes
    present = disk.keys()
    assert sorted(on_disk) == sorted(chunk_path(disk, int.from_bytes(k, "little")) for k in present)
    assert s.bytes == sum(p.stat().st_size for p in on_disk)


def test_a_waiting_put_takes_over_when_the_first_fails(
    make_disk: DiskFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Put B of the same key waits for put A; A fails, B writes. A third key finds
    the budget held by the writes in flight and is refused."""
    disk = make_disk(budget_bytes=FILE_BYTES)
    entered, go = threading.Event(), threading.Event()
    real_replace = os.replace
    calls: list[int] = []

    def replace_once_failing(src: str, dst: str) -> None:
        calls.append(1)
        if len(calls) == 1:
            entered.set()
            go.wait(5)
            raise OSError(5, "Input/output error")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace_once_failing)
    results: dict[str, bool] = {}
    first = threading.Thread(target=lambda: results.update(a=put(disk, 0)))
    first.start()
    assert entered.wait(5)
    second = threading.Thread(target=lambda: results.update(b=put(disk, 0)))
    second.start()
    assert not put(disk, 1)  # the budget is held by the write in flight
    second.join(0.05)
    assert second.is_alive()  # waiting for the first, not writing beside it
    go.set()
    first.join()
    second.join()
    assert results == {"a": False, "b": True}
    s = disk.stats()
    assert (s.writes, s.write_failures, s.files, s.evictions) == (1, 1, 1, 0)
    assert read(disk, 0) == payload(0, NBYTES)
    assert files_on_disk(disk) == [chunk_path(disk, 0)]
