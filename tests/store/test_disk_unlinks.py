"""The disk tier never holds its lock while it unlinks a file.

A put that evicts, a ``remove`` and a ``clear`` each delete files; on a
slow filesystem that takes long, and the lock guards what the transfer
server's loop (``contains``) and the model runner (``table_sizes``,
``stats``) ask every step. Here the unlink of one file is parked on a gate:
meanwhile every query is answered and other keys are put, and a put of the
key being unlinked waits for its unlink, then lands and stays.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from fabric.store import DiskTier
from fabric.store.checksum import checksum
from fabric.store.disk import HEADER_BYTES

from ._helpers import key

NBYTES = 64
DATA = bytes(range(NBYTES))


class ParkedUnlink:
    """``Path.unlink`` with the unlink of ``target`` parked until ``gate`` opens."""

    def __init__(self, real: Any, target: Path) -> None:
        self.real, self.target = real, target
        self.parked, self.gate = threading.Event(), threading.Event()

    def __call__(self, path: Path, missing_ok: bool = False) -> None:
        if path == self.target:
            self.parked.set()
            assert self.gate.wait(60), "the test never opened the gate"
        self.real(path, missing_ok=missing_ok)


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[DiskTier]:
    d = DiskTier(tmp_path, 3 * (HEADER_BYTES + NBYTES))  # room for 3 chunks
    for i in range(3):
        assert d.put(key(i), DATA, checksum(DATA))
    yield d
    d.close()


def park_unlink_of(disk: DiskTier, i: int, monkeypatch: pytest.MonkeyPatch) -> ParkedUnlink:
    parked = ParkedUnlink(Path.unlink, disk.root / key(i).hex()[:2] / f"{key(i).hex()}.chunk")

    def unlink(path: Path, missing_ok: bool = False) -> None:
        parked(path, missing_ok)

    monkeypatch.setattr(Path, "unlink", unlink)
    return parked


def in_thread(fn: Callable[[], object]) -> tuple[threading.Thread, list[object]]:
    out: list[object] = []
    thread = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    thread.start()
    return thread, out


def answered_meanwhile(disk: DiskTier, gone: int, kept: int) -> list[object]:
    """What the loop and the model runner ask, from another thread (a hang
    guard of 30 s: with the lock held across the unlink it would block)."""

    def ask() -> list[object]:
        out = bytearray(NBYTES)
        return [
            disk.table_sizes()["disk_writers"],
            disk.stats().files,
            disk.contains(key(gone)),
            disk.contains(key(kept)),
            disk.read_into(key(kept), out),
        ]

    asker, answers = in_thread(ask)
    asker.join(30)
    assert answers, "the disk tier did not answer while a file was being unlinked"
    return answers[0]  # type: ignore[return-value]


def waiting_put(disk: DiskTier, i: int) -> tuple[threading.Thread, list[object]]:
    """A put of key ``i``, which is being unlinked: returns once it waits for that."""
    slot = disk._writers[key(i)]  # NOTE: the writer slot its unlink holds
    real_wait, waiting = slot.wait, threading.Event()

    def wait(timeout: float | None = None) -> bool:
        waiting.set()
        return real_wait(timeout)

    slot.wait = wait  # type: ignore[method-assign]
    thread, out = in_thread(lambda: disk.put(key(i), DATA, checksum(DATA)))
    assert waiting.wait(30), "the put of a key being unlinked did not wait for it"
    return thread, out


def test_a_put_that_evicts_unlinks_outside_the_lock(
    disk: DiskTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    parked = park_unlink_of(disk, 0, monkeypatch)  # key 0: the least recently used
    evicting, evicted = in_thread(lambda: disk.put(key(3), DATA, checksum(DATA)))
    try:
        assert parked.parked.wait(30), "the put never evicted"
        # writers: key 3 (writing) and key 0 (unlinking); 2 files indexed
        assert answered_meanwhile(disk, gone=0, kept=1) == [2, 2, False, True, NBYTES]
        reput, reput_ok = waiting_put(disk, 0)
        assert not reput_ok and reput.is_alive()
    finally:
        parked.gate.set()
        evicting.join(30)
    reput.join(30)
    assert evicted == [True] and reput_ok == [True]
    assert disk.contains(key(0)) and disk.contains(key(3))  # the put after the unlink stays
    assert disk.read_into(key(0), bytearray(NBYTES)) == NBYTES
    assert disk.table_sizes()["disk_writers"] == 0 and disk.stats().files == 3


def test_remove_unlinks_outside_the_lock(disk: DiskTier, monkeypatch: pytest.MonkeyPatch) -> None:
    parked = park_unlink_of(disk, 1, monkeypatch)
    remover, removed = in_thread(lambda: disk.remove(key(1)))
    try:
        assert parked.parked.wait(30), "remove never unlinked"
        assert answered_meanwhile(disk, gone=1, kept=2) == [1, 2, False, True, NBYTES]
        assert disk.put(key(4), DATA, checksum(DATA))  # another key: not held up
        reput, reput_ok = waiting_put(disk, 1)
        assert not reput_ok and reput.is_alive()
    finally:
        parked.gate.set()
        remover.join(30)
    reput.join(30)
    assert removed == [True] and reput_ok == [True]
    assert disk.contains(key(1)) and disk.read_into(key(1), bytearray(NBYTES)) == NBYTES
    assert disk.table_sizes()["disk_writers"] == 0


def test_table_sizes_takes_no_lock(disk: DiskTier) -> None:
    """The model runner gauges the tables every step: it never waits for the
    disk tier's lock, whoever holds it."""
    with disk._lock:  # NOTE: as a put's bookkeeping would, for as long as it likes
        asker, answers = in_thread(disk.table_sizes)
        asker.join(30)
        assert answers == [{"disk_writers": 0}]
