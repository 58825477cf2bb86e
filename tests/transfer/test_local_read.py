"""Same-host reads (:mod:`fabric.transfer.local_read`) against real second
processes: who a peer is (the kernel says, not the peer), what is copied and
mapped, and a peer that dies, a read aborted and a reader closed while bytes
are landing."""

from __future__ import annotations

import fcntl
import json
import mmap
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import numpy as np
import pytest

from fabric.transfer import local_read
from fabric.transfer.dataplane import XferState
from fabric.transfer.local_read import (
    _SEALS,
    MAX_CALL_BYTES,
    MAX_IOVS,
    LocalHello,
    LocalPeer,
    LocalProcess,
    LocalReader,
    LocalServer,
    SharedRegion,
    _anonymous,
    calls,
    check_shared_file,
    release_unmapped,
    same_host,
    share_region,
    this_process,
    ucx_allows_local,
)
from fabric.transfer.nixl_plane import NixlDataPlane, NixlDescriptor, NixlRegions, nixl_available

pytestmark = pytest.mark.skipif(this_process() is None, reason="no /proc")

MIB = 1 << 20
HOLDER = """
import json, mmap, sys
import numpy as np
from fabric.transfer.local_read import LocalClient, share_region, this_process
n, mode, address = int(sys.argv[1]), sys.argv[2], sys.argv[3]
# NOTE: as a large malloc is (numpy's own would ask for huge pages)
buf = np.frombuffer(mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), np.uint8)
buf[:] = (np.arange(n, dtype=np.uint64) * 2654435761 % 251).astype(np.uint8)
# NOTE: a region not page-aligned, as a tensor in a malloc'd block is
shared = share_region(buf.ctypes.data + 64, n - 128) if mode == "share" else None
client = LocalClient()
regions = [shared] if shared else []
linked = address != "-" and client.connect(
    "test", address, regions, sender="holder", readable=[(buf.ctypes.data, n)]
)
me = this_process()
print(json.dumps({
    "addr": buf.ctypes.data,
    "local": [me.boot_id, me.pid_ns, me.net_ns, me.pid, me.start],
    "shared": shared and [shared.base, shared.nbytes, shared.fd, shared.inode],
    "token": client.token_for("test").hex() if linked else "",
}), flush=True)
for line in sys.stdin:  # NOTE: "poke I V": buf[I] = V, after sharing
    _, i, v = line.split()
    buf[int(i)] = int(v)
    print("ok", flush=True)
"""


class Holder:
    """A process holding ``nbytes`` of a known pattern, shared when told,
    linked to the :class:`LocalServer` at ``address`` when given."""

    def __init__(self, nbytes: int, *, share: bool = False, address: str = "-") -> None:
        self.nbytes = nbytes
        self.proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(nbytes), "share" if share else "keep", address],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        hello = json.loads(self.proc.stdout.readline())
        self.addr = int(hello["addr"])
        self.local = LocalProcess(*hello["local"])
        self.shared = SharedRegion(*hello["shared"]) if hello["shared"] else None
        self.token = bytes.fromhex(hello["token"])

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


class Server:
    """A :class:`LocalServer` and the peers it reported gone."""

    def __init__(self) -> None:
        self.gone: list[LocalPeer] = []
        self.went = threading.Event()
        self.server = LocalServer("test", self._gone)

    def _gone(self, peer: LocalPeer) -> None:
        self.gone.append(peer)
        self.went.set()


@pytest.fixture
def server() -> Iterator[Server]:
    s = Server()
    try:
        yield s
    finally:
        s.server.close()


@pytest.fixture
def holder() -> Iterator[Holder]:
    h = Holder(64 * MIB)
    try:
        yield h
    finally:
        h.stop()


@pytest.fixture
def sharer(server: Server) -> Iterator[Holder]:
    h = Holder(64 * MIB, share=True, address=server.server.address)
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


def test_same_host_is_this_boot_and_these_namespaces() -> None:
    me = this_process()
    assert me is not None and same_host(me)
    for other in (
        msgspec.structs.replace(me, net_ns=me.net_ns + 1),
        msgspec.structs.replace(me, pid_ns=me.pid_ns + 1),
        msgspec.structs.replace(me, boot_id="another"),
    ):
        assert not same_host(other)


def test_the_kernel_names_the_peer_and_its_link_ends_with_it(
    server: Server, sharer: Holder
) -> None:
    """What a peer's descriptors say of itself is never used: its link's
    socket credentials name it. A token names only its own link; the link
    closing (the peer died) reports the peer gone at once."""
    peer = server.server.peer(sharer.token)
    assert peer is not None and peer.alive
    assert (peer.pid, peer.start) == (sharer.local.pid, sharer.local.start)
    assert peer.pid != os.getpid()
    assert len(peer.fds) == 1 and peer.regions == [sharer.shared]
    assert server.server.peer(b"\x00" * 16) is None
    assert server.server.peer(b"") is None
    sharer.stop()
    assert server.went.wait(5), "the link's end was not noticed"
    assert server.gone == [peer] and not peer.alive and peer.fds == []
    assert server.server.peer(sharer.token) is None


def raw_link(address: str) -> socket.socket:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    conn.connect("\0" + address)
    conn.settimeout(5)
    return conn


def test_bad_links_are_refused_without_blocking(server: Server, tmp_path: Path) -> None:
    """Garbage, files that are not shared memory (a pipe, a FIFO, a file
    on disk, an unsealed or sparse memfd), regions without their files or at
    bases no share makes, a short token, a hello for another plane or from
    no one, readable ranges past the address range: refused, answered and
    counted; the server goes on."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    fifo_fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    disk = tmp_path / "disk"
    disk.write_bytes(b"\x00" * (4 * MIB))
    disk_fd = os.open(disk, os.O_RDONLY)
    unsealed = os.memfd_create("unsealed", os.MFD_CLOEXEC)
    os.ftruncate(unsealed, 4 * MIB)
    # NOTE: sealed as shared files are, but all holes: its pages would be
    # made (and charged) on this side as they are read
    sparse = os.memfd_create("sparse", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(sparse, 4 * MIB)
    fcntl.fcntl(sparse, fcntl.F_ADD_SEALS, _SEALS)
    pipe_r, pipe_w = os.pipe()
    good_file = allocation(8 * MIB)
    good_file[:] = 1
    shared = share_region(good_file.ctypes.data, good_file.nbytes)
    assert shared is not None
    try:
        cases: list[tuple[bytes, list[int]]] = [(b"\x93junk", [])]
        for fd in (fifo_fd, disk_fd, unsealed, sparse, pipe_r):
            region = SharedRegion(1 << 30, 4 * MIB, fd, os.fstat(fd).st_ino)
            cases.append(
                (msgspec.msgpack.encode(LocalHello(b"t" * 16, [region], "x", "test")), [fd])
            )
        region = SharedRegion(1 << 30, 4 * MIB, 3, 1)
        cases.append((msgspec.msgpack.encode(LocalHello(b"t" * 16, [region], "x", "test")), []))
        # NOTE: a good file named at bases no share makes: past any address
        # (sums would wrap), unaligned, or twice over one range
        for bad in (
            [msgspec.structs.replace(shared, base=(1 << 63) - 4096)],
            [msgspec.structs.replace(shared, base=shared.base + 1)],
            [shared, msgspec.structs.replace(shared, base=shared.base + 4096)],
        ):
            data = msgspec.msgpack.encode(LocalHello(b"t" * 16, bad, "x", "test"))
            cases.append((data, [shared.fd] * len(bad)))
        cases.append((msgspec.msgpack.encode(LocalHello(b"short", [], "x", "test")), []))
        # NOTE: a hello meant for another plane (its descriptor named this socket)
        cases.append((msgspec.msgpack.encode(LocalHello(b"t" * 16, [], "x", "other")), []))
        cases.append((msgspec.msgpack.encode(LocalHello(b"t" * 16, [], "", "test")), []))
        far = [((1 << 63) - 4096, 8192)]
        cases.append((msgspec.msgpack.encode(LocalHello(b"t" * 16, [], "x", "test", far)), []))
        for data, fds in cases:
            conn = raw_link(server.server.address)
            conn.sendmsg(
                [data],
                [(socket.SOL_SOCKET, socket.SCM_RIGHTS, bytes(np.array(fds, np.int32)))]
                if fds
                else [],
            )
            assert conn.recv(1) == b"\x00"
            conn.close()
        assert server.server.refused == len(cases)
        assert server.server.peer(b"t" * 16) is None
        good = raw_link(server.server.address)  # NOTE: and it still serves
        good.sendmsg([msgspec.msgpack.encode(LocalHello(b"g" * 16, [], "x", "test"))])
        assert good.recv(1) == b"\x01"
        found = server.server.peer(b"g" * 16)
        assert found is not None and found.pid == os.getpid()
        good.close()
    finally:
        for fd in (fifo_fd, disk_fd, unsealed, sparse, pipe_r, pipe_w):
            os.close(fd)


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


def test_a_shared_region_keeps_its_bytes_and_is_read_out_of_the_mapping(
    server: Server, sharer: Holder, reader: LocalReader
) -> None:
    shared = sharer.shared
    assert shared is not None  # NOTE: the inside pages, from the first aligned one
    assert shared.base == sharer.addr + mmap.PAGESIZE
    assert shared.nbytes == sharer.nbytes - 2 * mmap.PAGESIZE
    peer = server.server.peer(sharer.token)
    assert peer is not None
    pmap = reader.map(peer)
    assert pmap is not None
    dst = np.zeros(sharer.nbytes, dtype=np.uint8)
    rows = scattered(sharer, dst, 32 << 10, seed=3)
    handle = reader.post(peer.pid, peer.start, rows, pmap)
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
    assert wait(reader.post(peer.pid, peer.start, row, pmap)) is XferState.DONE
    assert one[0] == 7


def test_a_mapped_read_aborted_midway_stops(
    server: Server, sharer: Holder, reader: LocalReader
) -> None:
    peer = server.server.peer(sharer.token)
    assert peer is not None
    pmap = reader.map(peer)
    assert pmap is not None
    dst = np.zeros(sharer.nbytes, dtype=np.uint8)
    rows = np.concatenate([scattered(sharer, dst, 256 << 10)[4:-4]] * 64)  # NOTE: 4 GiB
    handle = reader.post(peer.pid, peer.start, rows, pmap)
    wait_some(handle)
    assert handle.abort() is True and handle.poll() is XferState.ERR
    copied = handle.copied
    assert 0 < copied < int(rows[:, 2].sum()) and copied == reader.mapped_bytes
    time.sleep(0.05)
    assert handle.copied == copied


def test_a_dead_owners_memory_is_let_go_at_the_next_read(
    server: Server, sharer: Holder, reader: LocalReader
) -> None:
    peer = server.server.peer(sharer.token)
    assert peer is not None and sharer.shared is not None
    pmap = reader.map(peer)
    assert pmap is not None and pmap.maps
    sharer.stop()
    dst = np.zeros(MIB, dtype=np.uint8)
    row = np.array([[dst.ctypes.data, sharer.shared.base, MIB]], dtype=np.int64)
    handle = reader.post(peer.pid, peer.start, row, pmap)
    assert wait(handle) is XferState.ERR and "gone" in str(handle.error)
    assert pmap.closed and not pmap.maps and not dst.any()


def test_only_the_sealed_memory_file_named_is_taken(server: Server, sharer: Holder) -> None:
    peer = server.server.peer(sharer.token)
    assert peer is not None and sharer.shared is not None
    shared, fd = sharer.shared, peer.fds[0]
    check_shared_file(fd, shared)
    for wrong in (
        msgspec.structs.replace(shared, inode=shared.inode + 1),
        msgspec.structs.replace(shared, nbytes=shared.nbytes + 4096),
    ):
        with pytest.raises(OSError):
            check_shared_file(fd, wrong)
    unsealed = os.memfd_create("unsealed", os.MFD_CLOEXEC)
    try:
        os.ftruncate(unsealed, 4 * MIB)
        region = SharedRegion(1 << 30, 4 * MIB, unsealed, os.fstat(unsealed).st_ino)
        with pytest.raises(OSError, match="not the region"):
            check_shared_file(unsealed, region)
    finally:
        os.close(unsealed)


def test_a_queued_read_aborts_at_once(holder: Holder, reader: LocalReader) -> None:
    dst = np.zeros(holder.nbytes, dtype=np.uint8)
    running = reader.post(holder.local.pid, holder.local.start, big_read(holder, dst, 64))
    queued = reader.post(holder.local.pid, holder.local.start, big_read(holder, dst, 1))
    wait_some(running)
    t0 = time.monotonic()
    assert queued.abort() is True
    assert time.monotonic() - t0 < 0.1  # NOTE: not behind the running 4 GiB read
    assert queued.poll() is XferState.ERR and queued.copied == 0
    assert running.poll() is XferState.PROC
    assert running.abort() is True


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


def test_memory_shared_again_is_the_same_region_and_its_file_goes_with_it() -> None:
    m = mmap.mmap(-1, 8 * MIB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = np.frombuffer(m, dtype=np.uint8)
    view[:] = 3
    first = share_region(view.ctypes.data, view.nbytes)
    assert first is not None
    # NOTE: a second plane registering the same memory (or part of it)
    assert share_region(view.ctypes.data, view.nbytes) == first
    assert share_region(view.ctypes.data + MIB, MIB * 4) == first
    release_unmapped()
    os.fstat(first.fd)  # NOTE: still mapped: kept
    del view
    m.close()  # NOTE: the memory is freed (munmap)
    release_unmapped()
    with pytest.raises(OSError):
        os.fstat(first.fd)


def child_linked(address: str, then: str) -> subprocess.Popen[str]:
    """A process that links to ``address`` (no regions), prints its token,
    then runs ``then`` (Python) with the link's socket ``conn`` open."""
    code = f"""
import os, socket, sys, time
from fabric.transfer.local_read import LocalClient
client = LocalClient()
assert client.connect("test", {address!r}, [], sender="child")
conn = client._conns["test"]
print(client.token_for("test").hex(), flush=True)
{then}
"""
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def token_of(proc: subprocess.Popen[str]) -> bytes:
    assert proc.stdout is not None
    return bytes.fromhex(proc.stdout.readline().strip())


def test_a_process_that_ends_while_its_link_lives_on_is_gone(server: Server) -> None:
    """The link's socket kept open by a forked child: the process that
    connected ended, so its pid may name another one soon: gone."""
    proc = child_linked(
        server.server.address,
        "if os.fork() == 0:\n    time.sleep(30)\nos._exit(0)",
    )
    try:
        token = token_of(proc)
        assert proc.wait(10) == 0
        assert server.went.wait(5), "an ended process kept its link"
        assert server.server.peer(token) is None
    finally:
        proc.kill()
        proc.wait()


def test_a_process_that_runs_another_program_is_gone(server: Server) -> None:
    proc = child_linked(
        server.server.address,
        "conn.set_inheritable(True)\nos.execv('/bin/sleep', ['sleep', '30'])",
    )
    try:
        token = token_of(proc)
        assert server.went.wait(5), "a process that ran another program kept its link"
        assert server.server.peer(token) is None
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a process as another user")
def test_a_link_from_another_user_is_refused(server: Server) -> None:
    code = f"""
import os, socket
os.setuid(65534)  # NOTE: nobody, after starting (it may not run this Python)
conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
conn.connect("\\0" + {server.server.address!r})
conn.settimeout(5)
print(repr(conn.recv(1)), flush=True)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.stdout.strip() == "b''", out  # NOTE: closed unanswered
    assert server.server.refused == 1


def test_silent_links_are_closed_and_do_not_crowd_out_others(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(local_read, "MAX_LOCAL_PEERS", 8)
    silent = [raw_link(server.server.address) for _ in range(8)]
    try:
        time.sleep(0.2)
        late = raw_link(server.server.address)
        assert late.recv(1) == b""  # NOTE: full: closed at once
        for conn in silent:  # NOTE: each closed for saying nothing in time
            assert conn.recv(1) == b""
        good = raw_link(server.server.address)
        good.sendmsg([msgspec.msgpack.encode(LocalHello(b"g" * 16, [], "x", "test"))])
        assert good.recv(1) == b"\x01"
        good.close()
        late.close()
    finally:
        for conn in silent:
            conn.close()


def test_a_server_whose_thread_stopped_serves_no_one(server: Server, sharer: Holder) -> None:
    assert server.server.peer(sharer.token) is not None

    def broken(timeout: float | None = None) -> list[object]:
        raise RuntimeError("broken")

    server.server._selector.select = broken  # type: ignore[method-assign,assignment]
    server.server._wake_w.send(b"x")
    server.server.thread.join(5)
    assert server.server.down and not server.server.thread.is_alive()
    assert server.server.peer(sharer.token) is None
    assert server.went.wait(5)  # NOTE: its peers' memory let go


def test_a_row_whose_end_would_wrap_is_not_copied_from_the_mapping(
    server: Server, sharer: Holder, reader: LocalReader
) -> None:
    peer = server.server.peer(sharer.token)
    assert peer is not None and sharer.shared is not None
    pmap = reader.map(peer)
    assert pmap is not None
    base = sharer.shared.base
    rows = np.array(
        [[0, base + 8192, (1 << 63) - 1], [0, base - 4096, 8192], [0, base, 4096]],
        dtype=np.int64,
    )
    mapped, rest = pmap.split(rows)
    assert mapped.tolist() == [[0, pmap.here[0], 4096]]
    assert rest.tolist() == rows[:2].tolist()


@pytest.mark.skipif(not nixl_available(), reason="no nixl")
def test_a_plane_hands_its_memory_only_with_a_region_descriptor(server: Server) -> None:
    """A Hello's descriptor may name any socket: loading it hands nothing
    over, and a link meant for one plane is refused by another's socket.
    The link (its files) goes with the first region descriptor for the
    plane it names, which only an Offer carries; the same descriptor loaded
    again (another Hello of that process) keeps it."""
    cache, pool = allocation(8 * MIB), allocation(MIB)
    cache[:] = 5
    p = NixlDataPlane("share-p", ucx_net_devices="lo")
    q = NixlDataPlane("share-q", ucx_net_devices="lo")
    deputy = LocalServer("share-q", lambda peer: None)  # NOTE: as q's own would
    try:
        p.register_pool(pool.ctypes.data, pool.nbytes)
        p.register_region(cache.ctypes.data, cache.nbytes)
        info = msgspec.msgpack.decode(q.descriptor(), type=NixlDescriptor)
        local = info.local
        assert local is not None

        def naming(address: str) -> bytes:
            there = msgspec.structs.replace(local, socket=address)
            return msgspec.msgpack.encode(msgspec.structs.replace(info, local=there))

        # NOTE: q's descriptor naming another plane's socket ("test")
        name = p.add_peer(naming(server.server.address))
        time.sleep(0.3)
        assert not server.server._conns  # NOTE: nothing handed over on a Hello
        tokens = msgspec.msgpack.decode(p.region_descriptor(name), type=NixlRegions)
        assert tokens.local_token == b"" and server.server.refused == 1
        assert not server.server._by_token
        # NOTE: the socket of the plane the descriptor is
        assert p.add_peer(naming(deputy.address)) == name
        token = msgspec.msgpack.decode(p.region_descriptor(name), type=NixlRegions).local_token
        linked = deputy.peer(token)
        assert linked is not None and linked.pid == os.getpid() and len(linked.fds) == 1
        assert linked.sender == "share-p" and (cache.ctypes.data, cache.nbytes) in linked.readable
        assert p.add_peer(naming(deputy.address)) == name
        again = msgspec.msgpack.decode(p.region_descriptor(name), type=NixlRegions).local_token
        assert again == token and deputy.peer(token) is linked
    finally:
        deputy.close()
        p.close()
        q.close()
