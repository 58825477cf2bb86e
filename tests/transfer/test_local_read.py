"""Same-host reads (:mod:`fabric.transfer.local_read`) against a real second
process: what is copied, when a peer is not read in place, and a peer that
dies, a read aborted and a reader closed while bytes are landing."""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import numpy as np
import pytest

from fabric.transfer.dataplane import XferState
from fabric.transfer.local_read import (
    MAX_CALL_BYTES,
    MAX_IOVS,
    LocalProcess,
    LocalReader,
    PeerMap,
    SharedRegion,
    _anonymous,
    calls,
    reachable,
    share_region,
    this_process,
    ucx_allows_local,
)

pytestmark = pytest.mark.skipif(this_process() is None, reason="no /proc")

MIB = 1 << 20
HOLDER = """
import json, mmap, sys
import numpy as np
from fabric.transfer.local_read import share_region, this_process
n = int(sys.argv[1])
# NOTE: as a large malloc is (numpy's own would ask for huge pages)
buf = np.frombuffer(mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), np.uint8)
buf[:] = (np.arange(n, dtype=np.uint64) * 2654435761 % 251).astype(np.uint8)
# NOTE: a region not page-aligned, as a tensor in a malloc'd block is
shared = share_region(buf.ctypes.data + 64, n - 128) if sys.argv[2] == "share" else None
me = this_process()
print(json.dumps({
    "addr": buf.ctypes.data,
    "local": [me.boot_id, me.pid_ns, me.net_ns, me.pid, me.start],
    "shared": shared and [shared.base, shared.nbytes, shared.fd, shared.inode],
}), flush=True)
for line in sys.stdin:  # NOTE: "poke I V": buf[I] = V, after sharing
    _, i, v = line.split()
    buf[int(i)] = int(v)
    print("ok", flush=True)
"""


class Holder:
    """A process holding ``nbytes`` of a known pattern."""

    def __init__(self, nbytes: int, *, share: bool = False) -> None:
        self.nbytes = nbytes
        self.proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(nbytes), "share" if share else "keep"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        hello = json.loads(self.proc.stdout.readline())
        self.addr = int(hello["addr"])
        self.local = LocalProcess(*hello["local"])
        self.shared = SharedRegion(*hello["shared"]) if hello["shared"] else None

    def poke(self, index: int, value: int) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"poke {index} {value}\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "ok"

    def pattern(self) -> np.ndarray:
        return (np.arange(self.nbytes, dtype=np.uint64) * 2654435761 % 251).astype(np.uint8)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@pytest.fixture
def holder() -> Iterator[Holder]:
    h = Holder(64 * MIB)
    try:
        yield h
    finally:
        h.stop()


@pytest.fixture
def reader() -> Iterator[LocalReader]:
    r = LocalReader("test")
    try:
        yield r
    finally:
        r.close()


def wait(handle: object, timeout: float = 30.0) -> XferState:
    deadline = time.monotonic() + timeout
    while (state := handle.poll()) is XferState.PROC:  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, "the read neither ended nor failed"
        time.sleep(1e-3)
    return state


def scattered(h: Holder, dst: np.ndarray, piece: int, seed: int = 0) -> np.ndarray:
    """Rows moving every ``piece`` of the holder's buffer to a shuffled place in ``dst``."""
    n = h.nbytes // piece
    to = np.random.default_rng(seed).permutation(n)
    return np.stack(
        [
            dst.ctypes.data + to * piece,
            h.addr + np.arange(n) * piece,
            np.full(n, piece),
        ],
        axis=1,
    ).astype(np.int64)


def test_ucx_tls_decides_whether_a_host_is_read_in_place() -> None:
    for tls, allowed in [
        (None, True),
        ("", True),
        ("all", True),
        ("sm,tcp", True),
        ("cma,rc", True),
        ("tcp", False),
        ("rc,tcp", False),
        ("^cma", False),
        ("^tcp", True),
        ("^ib,sm", False),
    ]:
        assert ucx_allows_local(tls) is allowed, tls


def test_calls_keep_every_byte_in_order_within_the_limits() -> None:
    rng = np.random.default_rng(1)
    lengths = np.concatenate(
        [rng.integers(1, 64 << 10, 3000), [MAX_CALL_BYTES * 2 + 5, 7, MAX_CALL_BYTES]]
    )
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    rows = np.stack([1000 + starts, 5000 + starts, lengths], axis=1).astype(np.int64)
    pieces = calls(rows)
    joined = np.concatenate(pieces)
    assert int(joined[:, 2].sum()) == int(lengths.sum())
    # NOTE: in order, each piece picking up where the previous ended on both sides
    ends = joined[:-1, :2] + joined[:-1, 2:3]
    assert (joined[1:, 0] >= ends[:, 0]).all()
    assert ((joined[1:, 0] - 1000) == (joined[1:, 1] - 5000)).all()
    assert all(len(p) <= MAX_IOVS and int(p[:, 2].sum()) <= MAX_CALL_BYTES for p in pieces)
    assert calls(np.zeros((0, 3), dtype=np.int64)) == []


def test_a_scattered_read_lands_every_byte(holder: Holder, reader: LocalReader) -> None:
    assert reachable(holder.local, holder.addr) is None
    dst = np.zeros(holder.nbytes, dtype=np.uint8)
    piece = 32 << 10
    rows = scattered(holder, dst, piece)
    handle = reader.post(holder.local.pid, holder.local.start, rows)
    assert wait(handle) is XferState.DONE and handle.copied == holder.nbytes
    n = holder.nbytes // piece
    to = np.random.default_rng(0).permutation(n)
    got = dst.reshape(n, piece)[to].reshape(-1)  # NOTE: piece i landed at slot to[i]
    assert np.array_equal(got, holder.pattern())
    assert (reader.reads, reader.failures, reader.bytes) == (1, 0, holder.nbytes)


def test_who_is_not_read_in_place(holder: Holder) -> None:
    me = this_process()
    assert me is not None
    other_net = LocalProcess(me.boot_id, me.pid_ns, me.net_ns + 1, holder.local.pid, 0)
    assert reachable(other_net, holder.addr) == "another host or namespace"
    other_boot = LocalProcess("x", me.pid_ns, me.net_ns, holder.local.pid, holder.local.start)
    assert reachable(other_boot, holder.addr) == "another host or namespace"
    reused = msgspec.structs.replace(holder.local, start=holder.local.start + 1)
    assert "another process now" in str(reachable(reused, holder.addr))
    assert "Bad address" in str(reachable(holder.local, 8))  # NOTE: not mapped there
    holder.stop()
    assert reachable(holder.local, holder.addr) is not None


def test_a_read_of_a_pid_that_is_another_process_now_lands_nothing(
    holder: Holder, reader: LocalReader
) -> None:
    dst = np.zeros(holder.nbytes, dtype=np.uint8)
    handle = reader.post(holder.local.pid, holder.local.start + 1, scattered(holder, dst, MIB))
    assert wait(handle) is XferState.ERR and "another process now" in str(handle.error)
    assert handle.copied == 0 and not dst.any()


def test_unmapped_memory_fails_the_read_not_the_reader(holder: Holder, reader: LocalReader) -> None:
    dst = np.zeros(holder.nbytes, dtype=np.uint8)
    rows = scattered(holder, dst, MIB)
    bad = rows.copy()
    bad[3, 1] = 4096  # NOTE: the first page is never mapped
    handle = reader.post(holder.local.pid, holder.local.start, bad)
    assert wait(handle) is XferState.ERR and handle.copied < holder.nbytes
    again = reader.post(holder.local.pid, holder.local.start, rows)
    assert wait(again) is XferState.DONE
    assert reader.failures == 1 and reader.reads == 1


def big_read(h: Holder, dst: np.ndarray, times: int) -> np.ndarray:
    """The holder's whole buffer read ``times`` times over (a long read)."""
    one = scattered(h, dst, 256 << 10)
    return np.concatenate([one] * times)


def wait_some(handle: object) -> None:
    deadline = time.monotonic() + 30
    while handle.copied == 0:  # type: ignore[attr-defined]
        assert time.monotonic() < deadline
        time.sleep(1e-4)


def test_a_peer_killed_mid_read_fails_it(holder: Holder, reader: LocalReader) -> None:
    dst = np.zeros(holder.nbytes, dtype=np.uint8)
    rows = big_read(holder, dst, 64)  # NOTE: 4 GiB: far longer than a kill takes
    handle = reader.post(holder.local.pid, holder.local.start, rows)
    wait_some(handle)
    holder.stop()
    assert wait(handle) is XferState.ERR
    assert 0 < handle.copied < 64 * holder.nbytes
    assert "gone" in str(handle.error) or "Bad address" in str(handle.error)


def test_an_abort_mid_read_stops_the_copy(holder: Holder, reader: LocalReader) -> None:
    dst = np.zeros(holder.nbytes, dtype=np.uint8)
    handle = reader.post(holder.local.pid, holder.local.start, big_read(holder, dst, 64))
    queued = reader.post(holder.local.pid, holder.local.start, big_read(holder, dst, 1))
    wait_some(handle)
    assert handle.abort() is True
    copied = handle.copied
    assert handle.poll() is XferState.ERR and handle.error == "aborted"
    assert 0 < copied < 64 * holder.nbytes
    assert wait(queued) is XferState.DONE  # NOTE: the next read runs
    assert handle.copied == copied


def test_closing_the_reader_mid_read_ends_every_read(holder: Holder) -> None:
    reader = LocalReader("closing")
    dst = np.zeros(holder.nbytes, dtype=np.uint8)
    running = reader.post(holder.local.pid, holder.local.start, big_read(holder, dst, 64))
    waiting = reader.post(holder.local.pid, holder.local.start, big_read(holder, dst, 1))
    wait_some(running)
    reader.close()
    assert running.poll() is XferState.ERR and waiting.poll() is XferState.ERR
    assert waiting.copied == 0
    copied = running.copied
    time.sleep(0.05)
    assert running.copied == copied  # NOTE: nothing lands after close returned
    late = reader.post(holder.local.pid, holder.local.start, big_read(holder, dst, 1))
    assert late.poll() is XferState.ERR and late.error == "the reader is closed"


@pytest.fixture
def sharer() -> Iterator[Holder]:
    h = Holder(64 * MIB, share=True)
    try:
        yield h
    finally:
        h.stop()


def test_a_shared_region_keeps_its_bytes_and_is_read_out_of_the_mapping(
    sharer: Holder, reader: LocalReader
) -> None:
    shared = sharer.shared
    assert shared is not None  # NOTE: the inside pages, from the first aligned one
    assert shared.base == sharer.addr + mmap.PAGESIZE
    assert shared.nbytes == sharer.nbytes - 2 * mmap.PAGESIZE
    pmap = reader.map(sharer.local.pid, [shared])
    assert pmap is not None
    dst = np.zeros(sharer.nbytes, dtype=np.uint8)
    rows = scattered(sharer, dst, 32 << 10, seed=3)
    handle = reader.post(sharer.local.pid, sharer.local.start, rows, pmap)
    assert wait(handle) is XferState.DONE
    n = sharer.nbytes // (32 << 10)
    to = np.random.default_rng(3).permutation(n)
    assert np.array_equal(dst.reshape(n, -1)[to].reshape(-1), sharer.pattern())
    # NOTE: all but the pieces in the buffer's partial first and last pages
    assert sharer.nbytes - 2 * (32 << 10) <= reader.mapped_bytes < sharer.nbytes
    assert reader.bytes == sharer.nbytes
    # NOTE: the owner's writes after sharing are what a reader sees
    sharer.poke(5 << 20, 7)
    one = np.zeros(1, dtype=np.uint8)
    row = np.array([[one.ctypes.data, sharer.addr + (5 << 20), 1]], dtype=np.int64)
    assert wait(reader.post(sharer.local.pid, sharer.local.start, row, pmap)) is XferState.DONE
    assert one[0] == 7


def test_a_dead_owners_memory_is_let_go_at_the_next_read(
    sharer: Holder, reader: LocalReader
) -> None:
    assert sharer.shared is not None
    pmap = reader.map(sharer.local.pid, [sharer.shared])
    assert pmap is not None and pmap.maps
    sharer.stop()
    dst = np.zeros(MIB, dtype=np.uint8)
    row = np.array([[dst.ctypes.data, sharer.shared.base, MIB]], dtype=np.int64)
    handle = reader.post(sharer.local.pid, sharer.local.start, row, pmap)
    assert wait(handle) is XferState.ERR and "gone" in str(handle.error)
    assert pmap.closed and not pmap.maps and not dst.any()


def test_only_the_sealed_file_the_owner_named_is_mapped(sharer: Holder) -> None:
    shared = sharer.shared
    assert shared is not None
    pid = sharer.local.pid
    for wrong in (
        msgspec.structs.replace(shared, inode=shared.inode + 1),
        msgspec.structs.replace(shared, nbytes=shared.nbytes - 4096),
        msgspec.structs.replace(shared, fd=0),  # NOTE: its stdin, a pipe
    ):
        with pytest.raises(OSError):
            PeerMap(pid, [wrong])
    # NOTE: a file that may shrink could fault the reader's copies: refused
    fd = os.memfd_create("unsealed", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, 4 * MIB)
        unsealed = SharedRegion(1 << 30, 4 * MIB, fd, os.fstat(fd).st_ino)
        with pytest.raises(OSError, match="not its region"):
            PeerMap(os.getpid(), [unsealed])
    finally:
        os.close(fd)
    assert PeerMap(pid, [shared]).maps  # NOTE: the right one is


def allocation(nbytes: int) -> np.ndarray:
    """Private anonymous memory in small pages, as a large malloc is."""
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return np.frombuffer(m, dtype=np.uint8)


def test_what_is_not_shared(tmp_path: Path) -> None:
    small = allocation(MIB)
    assert share_region(small.ctypes.data, small.nbytes) is None  # NOTE: too small
    big = allocation(8 * MIB)
    big[:] = 1
    assert share_region(4096 * 3 + 1, 8 * MIB) is None  # NOTE: not this process's memory
    path = tmp_path / "pages"
    path.write_bytes(b"\x01" * (8 * MIB))
    with path.open("rb") as f:  # NOTE: a file's pages are not an allocation
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        view = np.frombuffer(m, dtype=np.uint8)
        assert share_region(view.ctypes.data, len(view)) is None
        del view
        m.close()
    huge = np.ones(16 * MIB, dtype=np.uint8)  # NOTE: numpy asks for huge pages
    if _anonymous(huge.ctypes.data, huge.ctypes.data + huge.nbytes) is not None:
        assert share_region(huge.ctypes.data, huge.nbytes) is None
    shared = share_region(big.ctypes.data, big.nbytes)
    assert shared is not None and big.all()  # NOTE: the same bytes, now in the file
    big[:] = 2
    assert os.pread(shared.fd, 16, 0) == b"\x02" * 16
