"""Same-host reads: a peer's host memory copied in by ``process_vm_readv``.

A direct read (:meth:`~fabric.transfer.dataplane.DataPlane.post_read`) of
a paged cache has one descriptor per piece: a 16-token block of one layer's
K or V is 32 KiB in Llama-3-8B, so 256 MiB is ~8,000 descriptors. Between
two processes of one host, UCX moves each descriptor with its own
``process_vm_readv`` call (its ``cma`` transport), and the per-call cost
dominates: measured here (``fabric bench transfer``, 256 MiB in 32 KiB
pieces) ~72 ms against ~20 ms for a memcpy of the same bytes. One call
takes up to ``IOV_MAX`` (1,024) pieces, which brings the same read to
~30 ms.

:class:`LocalReader` is that: a plane's thread that copies each posted
read in calls of at most :data:`MAX_IOVS` pieces and :data:`MAX_CALL_BYTES`
bytes (so an abort waits one call at most), with the GIL released (ctypes
drops it for the call). The copy runs beside its poster, so a receiver
hashes one chunk while the next is copied.

Faster still, a plane shares the regions it registers
(:func:`share_region`): the page-aligned inside of each is moved, bytes
and all, onto a sealed memfd mapped at the same addresses, so the owner's
tensors do not change. A reader of the same host maps that file
(:class:`PeerMap`) and copies out of it with plain memory copies
(``fabric.kv._copy``), with no page pinned per call: measured here ~20 ms
per 256 MiB against ~55 ms for ``process_vm_readv`` of 4 KiB pages. What
lies outside the shared pages (a region's first and last partial page)
is read with ``process_vm_readv``.

Who is read is never what a peer says. A plane listens on an abstract
unix socket (:class:`LocalServer`; abstract names live in one network
namespace, and processes in other network namespaces stand for other
hosts). A peer whose descriptor says it is on this host (same boot, PID
and network namespace) connects to it (:class:`LocalClient`) when it
learns the plane's descriptor, passes its shared files with the message
(``SCM_RIGHTS``) and stays connected while it lives. The kernel names
the connecting process (``SO_PEERCRED``): only that process is read
(``process_vm_readv`` of its pid, checked against its start time at every
read), and only the files it passed are mapped, each checked to be a
sealed tmpfs file (:func:`check_shared_file`). A random token per link,
known to its two ends only, rides in the peer's region descriptors (sent
in its Offers), so a peer's Offers use its own link and no other's. A
link that closes (the peer exited) lets the peer's memory go at once.

Otherwise (no link, ``local_reads`` off, or ``UCX_TLS`` leaving out UCX's
own same-host copies: ``cma``, ``sm``, ``shm``, ``all``), and for a pid
the kernel will not let this process read (``EPERM``: other users without
``CAP_SYS_PTRACE``), reads go through NIXL as before. What is read is
bounded the same way: only the memory the peer named (its pool and the
regions it sent), checked by the plane before the read is posted; the
bytes are then verified against the chunk's checksum like any other read.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import errno
import fcntl
import itertools
import logging
import mmap
import os
import secrets
import select
import selectors
import socket
import stat
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from fabric.threads import thread as named_thread
from fabric.transfer.dataplane import WriteHandle, XferState

logger = logging.getLogger(__name__)

MAX_IOVS = 1024
"""Pieces per ``process_vm_readv`` call (Linux's ``IOV_MAX``)."""

MAX_CALL_BYTES = 16 << 20
"""Bytes per call at most: an abort waits for one call (~2 ms here)."""

ABORT_WAIT_S = 5.0
"""How long closing waits for the running call; a call is a memory copy
(nothing remote to wait for), so this is a bound, not a time it takes."""

RUNNING_ABORT_WAIT_S = 0.2
"""How long an abort waits for the running call (~2 ms); past it the abort
says bytes may still land (the receiver's quarantine covers them)."""

_CMA_TLS = frozenset({"all", "sm", "shm", "cma"})

MIN_SHARED_BYTES = 2 << 20
"""A region's shared inside is at least this large (a file per region)."""

SHARE_SLICE_BYTES = 64 << 20
"""A region is moved onto its file this much at a time (the extra memory
while it is moved)."""

_F_SEAL_FUTURE_WRITE = 0x0010  # NOTE: Linux 5.1; not in Python's fcntl
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | _F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL
"""What a shared file must carry: it cannot change size (a shrunk file
would fault a reader's copies: SIGBUS), nor be written or mapped writable
anew (its owner's mapping, made before, still writes; a reader cannot)."""
MAX_ADDRESS = 1 << 57
"""Above any user address (57-bit, 5-level paging): bases and ends beyond
it are refused before any sum could wrap."""
_MREMAP_MAYMOVE, _MREMAP_FIXED = 1, 2
_MAP_FAILED = ctypes.c_void_p(-1).value


class LocalProcess(msgspec.Struct, array_like=True, frozen=True):
    """Who a plane's process is, for a peer on the same host."""

    boot_id: str
    pid_ns: int
    net_ns: int
    pid: int
    start: int
    """Start time after boot (clock ticks, ``/proc/PID/stat``'s 22nd field)."""
    socket: str = ""
    """Its :class:`LocalServer`'s abstract socket name (empty: none)."""


def _ns(kind: str, pid: int | str = "self") -> int:
    st = os.stat(f"/proc/{pid}/ns/{kind}")
    return (st.st_dev << 32) ^ st.st_ino


def _start_time(pid: int | str) -> int:
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    # NOTE: the command name (field 2) may hold spaces and parentheses: split after its last ')'
    return int(stat[stat.rindex(b")") + 2 :].split()[19])


def this_process(socket: str = "") -> LocalProcess | None:
    """This process as a peer on this host sees it; None where ``/proc``
    does not say (not Linux, no procfs)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot_id = f.read().strip()
        return LocalProcess(
            boot_id, _ns("pid"), _ns("net"), os.getpid(), _start_time("self"), socket
        )
    except (OSError, ValueError, IndexError):
        return None


def ucx_allows_local(tls: str | None) -> bool:
    """Whether ``UCX_TLS`` (``tls``) lets UCX copy between processes of one
    host itself; local reads follow it (a test or an operator that forces
    ``tcp`` gets the network)."""
    if tls is None or not tls.strip():
        return True
    names = [t.strip().lower() for t in tls.split(",") if t.strip()]
    if names and names[0].startswith("^"):
        names[0] = names[0][1:]
        return not _CMA_TLS.intersection(names)
    return bool(_CMA_TLS.intersection(names))


_libc: ctypes.CDLL | None = None


def _c() -> Any:
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
        libc.fstatfs.restype = ctypes.c_int
        libc.fstatfs.argtypes = [ctypes.c_int, ctypes.c_void_p]
        libc.munmap.restype = ctypes.c_int
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.process_vm_readv.restype = ctypes.c_ssize_t
        libc.process_vm_readv.argtypes = [
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.c_ulong,
            ctypes.c_void_p,
            ctypes.c_ulong,
            ctypes.c_ulong,
        ]
        libc.mremap.restype = ctypes.c_void_p
        libc.mremap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_void_p,
        ]
        _libc = libc
    return _libc


def _oserror(what: str) -> OSError:
    err = ctypes.get_errno()
    return OSError(err, f"{what}: {os.strerror(err)}")


def read_rows(pid: int, rows: np.ndarray) -> int:
    """Copy Nx3 rows (local address, remote address, nbytes) from ``pid`` in
    one ``process_vm_readv`` call (the GIL released); returns the bytes it
    copied. Raises OSError on the call's error; fewer bytes than asked means
    a remote range failed partway."""
    n = len(rows)
    if not n:
        return 0
    local = np.empty((n, 2), dtype=np.uint64)
    remote = np.empty((n, 2), dtype=np.uint64)
    local[:, 0], remote[:, 0] = rows[:, 0], rows[:, 1]
    local[:, 1] = remote[:, 1] = rows[:, 2]
    got = _c().process_vm_readv(pid, local.ctypes.data, n, remote.ctypes.data, n, 0)
    if got < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return int(got)


def calls(rows: np.ndarray) -> list[np.ndarray]:
    """``rows`` cut into calls: rows longer than :data:`MAX_CALL_BYTES` split,
    then at most :data:`MAX_IOVS` rows and :data:`MAX_CALL_BYTES` per call."""
    rows = np.asarray(rows, dtype=np.int64).reshape(-1, 3)
    long = rows[:, 2] > MAX_CALL_BYTES
    if long.any():
        pieces = []
        for row in rows:
            if row[2] <= MAX_CALL_BYTES:
                pieces.append(row[None, :])
                continue
            at = np.arange(0, int(row[2]), MAX_CALL_BYTES, dtype=np.int64)
            cut = np.stack([row[0] + at, row[1] + at, np.minimum(MAX_CALL_BYTES, row[2] - at)], 1)
            pieces.append(cut)
        rows = np.concatenate(pieces)
    out, start, size = [], 0, 0
    for i, nbytes in enumerate(rows[:, 2].tolist()):
        if i > start and (i - start >= MAX_IOVS or size + nbytes > MAX_CALL_BYTES):
            out.append(rows[start:i])
            start, size = i, 0
        size += nbytes
    if start < len(rows):
        out.append(rows[start:])
    return out


def same_host(peer: LocalProcess, me: LocalProcess | None = None) -> bool:
    """Whether ``peer`` says it is on this host, in this process's PID and
    network namespaces (``me``: this process, read from ``/proc`` if not
    given; a claim: :class:`LocalServer` has the kernel prove who connects)."""
    me = me if me is not None else this_process()
    return me is not None and (peer.boot_id, peer.pid_ns, peer.net_ns) == (
        me.boot_id,
        me.pid_ns,
        me.net_ns,
    )


class SharedRegion(msgspec.Struct, array_like=True, frozen=True):
    """Memory of a plane's process kept in a file a reader of its host maps."""

    base: int
    """Where it lies in the owner's memory (page-aligned)."""
    nbytes: int
    fd: int
    """The owner's descriptor of the file (``/proc/PID/fd/FD``)."""
    inode: int


def _anonymous(lo: int, hi: int) -> str | None:
    """Why [lo, hi) is not plain private anonymous memory of this process
    (None: it is; what a large allocation is, not the heap, a stack or a
    file). Memory already in transparent huge pages stays as it is: the
    file's pages would be small ones, and the owner's own reads slower."""
    covered, inside = lo, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=5)
            if "-" in head[0] and len(head) >= 5:
                a, b = (int(x, 16) for x in head[0].split("-"))
                if inside and covered >= hi:
                    return None
                inside = a <= covered < b
                if not inside:
                    continue
                if head[1][:2] != "rw" or head[1][3] != "p" or head[4] != "0":
                    return f"not private anonymous memory ({line.strip()})"
                if len(head) > 5 and head[5].strip():
                    return f"not an allocation ({head[5].strip()})"
                covered = b
            elif inside and head[0] == "AnonHugePages:" and int(head[1]) > 0:
                return "in transparent huge pages"
    return None if inside and covered >= hi else "not all mapped"


_shared_here: dict[int, SharedRegion] = {}
"""This process's shared regions by base; their files stay open while
their memory is mapped (:func:`release_unmapped`)."""
_shared_lock = threading.Lock()
MEMFD_NAME = "fabric-kv"


def release_unmapped() -> None:
    """Close the files of shared regions whose memory is no longer mapped
    here (their tensors were freed), so the kernel frees their pages."""
    live: set[int] = set()
    with open("/proc/self/maps") as f:
        for line in f:
            if MEMFD_NAME in line:
                live.add(int(line.split()[4]))
    with _shared_lock:
        for base, region in list(_shared_here.items()):
            if region.inode not in live:
                del _shared_here[base]
                with contextlib.suppress(OSError):
                    os.close(region.fd)


def share_region(base: int, nbytes: int) -> SharedRegion | None:
    """Move the page-aligned inside of [base, base + nbytes) onto a sealed
    memfd mapped at the same addresses (see the module docstring); None when
    it is too small, not a private anonymous allocation, or the kernel says
    no. Memory this process shared before (another plane registered it) is
    that region again. NOTE: the memory must not be written meanwhile (a
    write between a slice's copy and its move is lost): fabric shares a KV
    cache when vLLM registers it, before any forward runs. What was moved
    before a failure stays moved (it is memory like before)."""
    page = mmap.PAGESIZE
    lo, hi = -(-base // page) * page, (base + nbytes) // page * page
    if hi - lo < MIN_SHARED_BYTES:
        return None
    try:
        release_unmapped()
    except OSError as exc:
        logger.debug("not sharing %#x..%#x: %s", lo, hi, exc)
        return None
    with _shared_lock:  # NOTE: two planes sharing one memory at once must not interleave
        return _share_locked(lo, hi)


def _share_locked(lo: int, hi: int) -> SharedRegion | None:
    try:
        for region in _shared_here.values():
            if region.base <= lo and hi <= region.base + region.nbytes:
                return region
        why = _anonymous(lo, hi)
        if why is not None:
            logger.debug("not sharing %#x..%#x: %s", lo, hi, why)
            return None
        fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except OSError as exc:
        logger.debug("not sharing %#x..%#x: %s", lo, hi, exc)
        return None
    libc, done = _c(), 0
    try:
        os.ftruncate(fd, hi - lo)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        prot, flags = mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | mmap.MAP_POPULATE
        while done < hi - lo:
            n = min(SHARE_SLICE_BYTES, hi - lo - done)
            tmp = libc.mmap(None, n, prot, flags, fd, done)
            if tmp in (None, _MAP_FAILED):
                raise _oserror("mmap")
            ctypes.memmove(tmp, lo + done, n)
            # NOTE: mremap moves the file's pages over the old ones in one
            # step; had it failed, the old ones would still be there
            moved = libc.mremap(tmp, n, n, _MREMAP_MAYMOVE | _MREMAP_FIXED, lo + done)
            if moved != lo + done:
                err = _oserror("mremap")
                libc.munmap(tmp, n)
                raise err
            done += n
    except Exception as exc:
        logger.warning("sharing %d MiB of a region for same-host reads: %s", (hi - lo) >> 20, exc)
        if done < MIN_SHARED_BYTES:
            os.close(fd)
            return None
    try:
        # NOTE: after the move: the mapping made before keeps writing, no other can
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL)
    except OSError as exc:
        logger.warning("sealing a shared region: %s (not shared)", exc)
        os.close(fd)
        return None
    region = SharedRegion(lo, done, fd, os.fstat(fd).st_ino)
    _shared_here[lo] = region
    return region


def live_regions(regions: list[SharedRegion]) -> list[SharedRegion]:
    """Those of ``regions`` this process still shares (their files open)."""
    release_unmapped()
    with _shared_lock:
        live = set(_shared_here.values())
    return [r for r in regions if r in live]


_TMPFS_MAGIC = 0x01021994


def _fs_type(fd: int) -> int:
    buf = ctypes.create_string_buffer(256)  # NOTE: struct statfs; f_type comes first
    if _c().fstatfs(fd, buf) != 0:
        raise _oserror("fstatfs")
    return ctypes.c_long.from_buffer(buf).value


def check_region(region: SharedRegion) -> None:
    """Refuse (ValueError) a region no :func:`share_region` makes: a base
    not page-aligned, no bytes, or beyond :data:`MAX_ADDRESS`."""
    base, nbytes = region.base, region.nbytes
    if not (base > 0 and nbytes > 0 and base + nbytes <= MAX_ADDRESS) or base % mmap.PAGESIZE:
        raise ValueError(f"a shared region at {base:#x} of {nbytes} bytes")


def check_shared_file(fd: int, region: SharedRegion) -> None:
    """Refuse (OSError) a file passed as ``region`` unless it is what
    :func:`share_region` makes: a memfd (its name, before anything else is
    asked of it, so no other kind of file can block this thread) of tmpfs
    (not hugetlbfs, whose holes fault), sealed as :data:`_SEALS` says, of
    the inode named, large enough and with every page there (no holes to
    fault in on this side)."""
    check_region(region)
    if not os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:"):
        raise OSError(errno.EINVAL, "not a memory file")
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or _fs_type(fd) != _TMPFS_MAGIC:
        raise OSError(errno.EINVAL, "not a memory file")
    seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    if st.st_ino != region.inode or st.st_size < region.nbytes or ~seals & _SEALS:
        raise OSError(errno.EINVAL, "not the region named (inode, size or seals)")
    if st.st_blocks * 512 < region.nbytes or os.lseek(fd, 0, os.SEEK_HOLE) < region.nbytes:
        raise OSError(errno.EINVAL, "the file has holes")


class PeerMap:
    """A peer's shared regions mapped into this process (read-only), from
    the files it passed (:class:`LocalServer`). Used and unmapped by
    :class:`LocalReader`'s thread only, after every read posted before: no
    copy runs out of an unmapped range."""

    def __init__(self, pid: int, regions: list[SharedRegion], fds: list[int]) -> None:
        libc = _c()
        self.pid = pid
        self.maps: list[tuple[int, int]] = []  # (address here, nbytes)
        self.closed = False
        pairs = sorted(zip(regions, fds, strict=True), key=lambda p: p[0].base)
        try:
            for r, fd in pairs:
                check_shared_file(fd, r)
                addr = libc.mmap(None, r.nbytes, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
                if addr in (None, _MAP_FAILED):
                    raise _oserror("mmap")
                self.maps.append((int(addr), r.nbytes))
        except OSError:
            self.unmap()
            raise
        self.bases = np.array([r.base for r, _ in pairs], np.int64)
        self.ends = self.bases + np.array([n for _, n in self.maps], np.int64)
        self.here = np.array([a for a, _ in self.maps], np.int64)

    def split(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``rows`` as (rows copied from the mapping, their source addresses
        here; rows left to ``process_vm_readv``)."""
        if self.closed or not len(self.bases):
            return rows[:0], rows
        at = np.searchsorted(self.bases, rows[:, 1], side="right") - 1
        ok = at >= 0
        at = np.maximum(at, 0)
        ok &= (rows[:, 1] >= self.bases[at]) & (rows[:, 2] <= self.ends[at] - rows[:, 1])
        mapped = rows[ok].copy()
        mapped[:, 1] = mapped[:, 1] - self.bases[at[ok]] + self.here[at[ok]]
        return mapped, rows[~ok]

    def unmap(self) -> None:
        self.closed = True
        libc = _c()
        for addr, n in self.maps:
            libc.munmap(addr, n)
        self.maps = []


class LocalHello(msgspec.Struct, array_like=True, frozen=True):
    """What a plane tells a same-host peer's :class:`LocalServer`: the token
    its region descriptors for that peer carry, its shared regions (whose
    files come with the message: ``SCM_RIGHTS``, in this order), the agent
    names of both ends (a server refuses a hello meant for another agent:
    a descriptor that named another plane's socket gets nothing), and the
    ranges of its memory it lets that peer read (its pool and registered
    regions): reads beyond them are never done in place, whatever an Offer
    claims."""

    token: bytes
    regions: list[SharedRegion]
    sender: str = ""
    receiver: str = ""
    readable: list[tuple[int, int]] = []


@dataclass(eq=False)
class LocalPeer:
    """A same-host peer as the kernel says it is: ``pid`` from the socket's
    credentials (``SO_PEERCRED``), not from anything the peer wrote."""

    pid: int
    start: int
    token: bytes
    regions: list[SharedRegion] = field(default_factory=list)
    fds: list[int] = field(default_factory=list)
    alive: bool = True
    sender: str = ""
    """The agent name the peer linked as."""
    readable: list[tuple[int, int]] = field(default_factory=list)
    """What the peer lets this process read in place (base, nbytes)."""

    def close_fds(self) -> None:
        fds, self.fds = self.fds, []
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)


MAX_LOCAL_PEERS = 256
"""Connections a :class:`LocalServer` keeps at most (more are refused)."""

MAX_SHARED_FILES = 250
"""Files one :class:`LocalHello` may pass (the kernel passes 253 at most):
a region per KV cache tensor (vLLM allocates one per layer or group)."""

MAX_HELLO_BYTES = 64 << 10

ACK_WAIT_S = 0.5
"""How long a plane waits for a same-host peer to take its hello (under a
link's stall threshold: a slow answer does not make the peer look stalled)."""

HELLO_WAIT_S = 1.0
"""How long a :class:`LocalServer` keeps a link that sent no hello."""

SWEEP_S = 0.5
"""How often a :class:`LocalServer` checks its peers' processes."""


@dataclass(eq=False)
class _Conn:
    """A connection as accepted: who the kernel said connected, and when."""

    pid: int
    identity: tuple[int, str]
    accepted: float
    peer: LocalPeer | None = None


def _identity(pid: int) -> tuple[int, str]:
    """What tells a process from a later one under its pid: its start time
    and its program (an ``exec`` keeps the pid and the start time)."""
    return _start_time(pid), os.readlink(f"/proc/{pid}/exe")


class LocalServer:
    """An abstract unix socket (so: this network namespace only) where a
    same-host peer's plane connects, passes its shared files and stays
    connected while it lives. The kernel names the connecting process
    (``SO_PEERCRED``, taken as it is accepted): a peer is read in place only
    as the process it is, whatever its descriptors say, so it cannot have
    this process read another's memory (or its own); only processes of this
    user are taken. The token binds the connection to the peer's region
    descriptors (sent only in its Offers). A connection whose process ended
    or changed (its start time or program, checked every
    :data:`SWEEP_S`), or that closed, calls ``on_gone`` at once: its memory is
    unmapped here. One that sends nothing within :data:`HELLO_WAIT_S` is
    closed. One thread; each message is taken whole without blocking
    (``SOCK_SEQPACKET``); if the thread ever stops, no peer is served (reads
    go through UCX) and ``down`` says so."""

    def __init__(self, name: str, on_gone: Callable[[LocalPeer], None]) -> None:
        self.name = name
        """This end's agent name: hellos for another are refused."""
        self.address = f"fabric-local-{os.getpid()}-{secrets.token_hex(8)}"
        self._on_gone = on_gone
        self._lock = threading.Lock()
        self._by_token: dict[bytes, LocalPeer] = {}
        self._conns: dict[socket.socket, _Conn] = {}
        self.refused = 0
        self.down = False
        flags = socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK
        self._listener = socket.socket(socket.AF_UNIX, flags)
        self._listener.bind("\0" + self.address)
        self._listener.listen(64)
        self._wake_r, self._wake_w = socket.socketpair()
        self._closed = False
        self._paused_until = 0.0
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self.thread = named_thread(
            self._run, name=f"fabric-local-server-{name}", os_name="fabric-link"
        )
        self.thread.start()

    def peer(self, token: bytes) -> LocalPeer | None:
        """The live peer whose connection carried ``token``."""
        with self._lock:
            found = self._by_token.get(token) if not self.down else None
        return found if found is not None and found.alive else None

    def _run(self) -> None:
        try:
            next_sweep = time.monotonic() + SWEEP_S
            while not self._closed:
                # NOTE: nothing to sweep (no connection, not paused): wait for one
                idle = not self._conns and not self._paused_until
                timeout = None if idle else max(0.0, next_sweep - time.monotonic())
                for key, _ in self._selector.select(timeout):
                    try:
                        if key.fileobj is self._listener:
                            self._accept()
                        elif key.fileobj is not self._wake_r:
                            self._receive(key.fileobj)  # type: ignore[arg-type]
                    except Exception:  # NOTE: one connection fails, the server goes on
                        logger.exception("local server %s", self.address)
                if idle:
                    next_sweep = time.monotonic() + SWEEP_S  # NOTE: a new link's first sweep
                elif time.monotonic() >= next_sweep:
                    self._sweep()
                    next_sweep = time.monotonic() + SWEEP_S
        except BaseException:
            logger.exception(
                "local server %s stopped: same-host reads go through UCX", self.address
            )
        finally:
            if not self._closed:
                self.down = True
                for conn in list(self._conns):
                    self._drop(conn, [])
                with contextlib.suppress(OSError):
                    self._listener.close()  # NOTE: peers' links fail at once, not after a wait

    def _sweep(self) -> None:
        """Close what sent no hello in time, and the links of processes
        that ended or changed; listen again after a pause."""
        now = time.monotonic()
        if self._paused_until and now >= self._paused_until:
            self._paused_until = 0.0
            self._selector.register(self._listener, selectors.EVENT_READ)
        for conn, c in list(self._conns.items()):
            if c.peer is None:
                if now - c.accepted > HELLO_WAIT_S:
                    self.refused += 1
                    self._drop(conn, [])
                continue
            try:
                same = _identity(c.pid) == c.identity
            except (OSError, ValueError, IndexError):
                same = False
            if not same:
                self._drop(conn, [])

    def _accept(self) -> None:
        try:
            conn, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:  # NOTE: e.g. no fd left: stop listening a while, not spin
            logger.warning("local server %s: %s; pausing", self.address, exc)
            self._selector.unregister(self._listener)
            self._paused_until = time.monotonic() + SWEEP_S
            return
        try:
            conn.setblocking(False)
            pid, uid, _ = struct.unpack(
                "3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
            )
            if len(self._conns) >= MAX_LOCAL_PEERS:
                raise ValueError("too many links")
            if uid != os.getuid():
                raise ValueError(f"uid {uid} is not this process's")
            if pid <= 0:
                raise ValueError("the peer is not in this PID namespace")
            identity = _identity(pid)
        except (ValueError, OSError, IndexError) as exc:
            self.refused += 1
            logger.info("local server %s refused a link: %s", self.address, exc)
            conn.close()
            return
        self._conns[conn] = _Conn(pid, identity, time.monotonic())
        self._selector.register(conn, selectors.EVENT_READ)

    def _receive(self, conn: socket.socket) -> None:
        fds: list[int] = []
        try:
            data, ancdata, msg_flags, _ = conn.recvmsg(
                MAX_HELLO_BYTES,
                socket.CMSG_SPACE(MAX_SHARED_FILES * 4),
                socket.MSG_CMSG_CLOEXEC,
            )
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data, ancdata, msg_flags = b"", [], 0
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.extend(array.array("i", payload[: len(payload) - len(payload) % 4]))
        c = self._conns.get(conn)
        if not data or c is None:
            self._drop(conn, fds)
            return
        try:
            if msg_flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC):
                raise ValueError("a message or its files were cut")
            hello = msgspec.msgpack.decode(data, type=LocalHello)
            if len(hello.regions) != len(fds):
                raise ValueError(f"{len(hello.regions)} regions with {len(fds)} files")
            if len(hello.token) < 16:
                raise ValueError("a short token")
            if hello.receiver != self.name or not hello.sender:
                raise ValueError(f"a hello for {hello.receiver!r} from {hello.sender!r}")
            if any(not (b > 0 and n > 0 and b + n <= MAX_ADDRESS) for b, n in hello.readable):
                raise ValueError("readable ranges past the user address range")
            spans = sorted((r.base, r.base + r.nbytes) for r in hello.regions)
            if any(b[0] < a[1] for a, b in itertools.pairwise(spans)):
                raise ValueError("overlapping regions")
            for region, fd in zip(hello.regions, fds, strict=True):
                check_shared_file(fd, region)
            if _identity(c.pid) != c.identity:
                raise ValueError(f"pid {c.pid} is not the process that connected")
        except (ValueError, OSError, msgspec.DecodeError, IndexError) as exc:
            self.refused += 1
            logger.warning("local server %s refused a peer: %s", self.address, exc)
            with contextlib.suppress(OSError):
                conn.send(b"\x00")
            self._drop(conn, fds)
            return
        peer = LocalPeer(
            c.pid,
            c.identity[0],
            hello.token,
            list(hello.regions),
            fds,
            sender=hello.sender,
            readable=[(int(b), int(n)) for b, n in hello.readable],
        )
        with self._lock:
            old, c.peer = c.peer, peer
            if old is not None:  # NOTE: an update (more shared regions): the newer stands
                self._by_token.pop(old.token, None)
            self._by_token[hello.token] = peer
        if old is not None:
            self._gone(old)
        with contextlib.suppress(OSError):
            conn.send(b"\x01")  # NOTE: registered: the peer's Offers may name it now

    def _drop(self, conn: socket.socket, fds: list[int]) -> None:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn)
        with self._lock:
            c = self._conns.pop(conn, None)
            peer = c.peer if c is not None else None
            if peer is not None and self._by_token.get(peer.token) is peer:
                del self._by_token[peer.token]
        conn.close()
        if peer is not None:
            self._gone(peer)

    def _gone(self, peer: LocalPeer) -> None:
        peer.alive = False
        try:
            self._on_gone(peer)
        finally:
            peer.close_fds()

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        self.thread.join(ABORT_WAIT_S)
        for conn in list(self._conns):
            self._drop(conn, [])
        for sock in (self._listener, self._wake_r, self._wake_w):
            sock.close()
        self._selector.close()


class LocalClient:
    """The other end: one connection per same-host peer's :class:`LocalServer`,
    made when this plane first names its regions to that peer (an Offer, so
    only to a peer that answered its Hello and granted a Reserve) and kept
    open while both live. It waits :data:`ACK_WAIT_S` at most: a server
    that does not take the link or its message gets none (reads then go
    through UCX)."""

    def __init__(self) -> None:
        self._conns: dict[str, socket.socket] = {}
        self._tokens: dict[str, bytes] = {}
        self._hellos: dict[str, LocalHello] = {}
        self._lock = threading.Lock()

    def token_for(self, peer: str) -> bytes:
        """The token of the link to ``peer`` (empty: none): random per link,
        known to the two ends only."""
        with self._lock:
            return self._tokens.get(peer, b"")

    def connect(
        self,
        peer: str,
        address: str,
        regions: list[SharedRegion],
        *,
        sender: str = "",
        readable: list[tuple[int, int]] | None = None,
    ) -> bool:
        """Link to ``peer`` (its agent name) at ``address``, as ``sender``,
        letting it read ``readable`` in place."""
        self.drop(peer)
        flags = socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK
        conn = socket.socket(socket.AF_UNIX, flags)
        token = secrets.token_bytes(16)
        try:
            conn.connect("\0" + address)
            hello = LocalHello(token, regions[:MAX_SHARED_FILES], sender, peer, readable or [])
            self._send(conn, hello)
            ok = self._acked(conn)
        except OSError as exc:
            ok, why = False, str(exc)
        else:
            why = "the peer did not take it"
        if not ok:
            logger.info("no same-host link to %s: %s", peer, why)
            conn.close()
            return False
        with self._lock:
            self._conns[peer] = conn
            self._tokens[peer] = token
            self._hellos[peer] = hello
        return True

    @staticmethod
    def _send(conn: socket.socket, hello: LocalHello) -> None:
        data = msgspec.msgpack.encode(hello)
        fds = array.array("i", [r.fd for r in hello.regions])
        ancdata = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds.tobytes())] if fds else []
        conn.sendmsg([data], ancdata)

    @staticmethod
    def _acked(conn: socket.socket) -> bool:
        """Whether the server registered the last message (its answer, waited
        for :data:`ACK_WAIT_S` at most: a local socket answers in
        microseconds; the wait orders this plane's later Offers after it)."""
        if not select.select([conn], [], [], ACK_WAIT_S)[0]:
            return False
        return conn.recv(1) == b"\x01"

    def linked(self, peer: str) -> bool:
        with self._lock:
            return peer in self._conns

    def update(self, regions: list[SharedRegion], readable: list[tuple[int, int]]) -> None:
        """Tell every connected peer of this plane's shared regions and
        readable ranges now; a link that does not take it is closed (the
        peer reads through UCX)."""
        with self._lock:
            conns = [(peer, conn, self._hellos[peer]) for peer, conn in self._conns.items()]
        for peer, conn, old in conns:
            hello = msgspec.structs.replace(
                old, regions=regions[:MAX_SHARED_FILES], readable=readable
            )
            try:
                self._send(conn, hello)
                ok = self._acked(conn)
                if ok:
                    with self._lock:
                        if self._conns.get(peer) is conn:
                            self._hellos[peer] = hello
            except (OSError, ValueError) as exc:  # NOTE: ValueError: closed meanwhile
                ok = False
                logger.info("same-host link to %s: %s", peer, exc)
            if not ok:
                with self._lock:
                    if self._conns.get(peer) is conn:
                        del self._conns[peer], self._tokens[peer], self._hellos[peer]
                conn.close()

    def drop(self, peer: str) -> None:
        with self._lock:
            conn = self._conns.pop(peer, None)
            self._tokens.pop(peer, None)
            self._hellos.pop(peer, None)
        if conn is not None:
            conn.close()

    def close(self) -> None:
        with self._lock:
            conns, self._conns = list(self._conns.values()), {}
            self._tokens.clear()
            self._hellos.clear()
        for conn in conns:
            conn.close()


def _copier() -> Any:
    """``fabric.kv._copy`` (batched memcpy, the GIL released), or None
    where it was not built: then nothing is copied out of a mapping."""
    from fabric.kv.pack import _copy

    return _copy


@dataclass(eq=False)
class _Job:
    pid: int
    start: int
    rows: np.ndarray
    pmap: PeerMap | None = None
    unmap: bool = False
    """A job that only unmaps ``pmap`` (after every read posted before it)."""
    done: threading.Event = field(default_factory=threading.Event)
    copied: int = 0
    cancelled: bool = False
    error: str | None = None


class LocalRead(WriteHandle):
    """A read :class:`LocalReader` runs; ``poll`` never blocks."""

    def __init__(self, reader: LocalReader, job: _Job) -> None:
        self._reader = reader
        self.job = job

    @property
    def error(self) -> str | None:
        return self.job.error

    @property
    def copied(self) -> int:
        """Bytes copied so far."""
        return self.job.copied

    def poll(self) -> XferState:
        if not self.job.done.is_set():
            return XferState.PROC
        return XferState.ERR if self.job.error is not None else XferState.DONE

    def abort(self) -> bool:
        """Stop it: one still queued at once; the running one after its
        call (waited for :data:`RUNNING_ABORT_WAIT_S` at most). True once
        no byte can land any more."""
        job = self.job
        if not job.done.is_set():
            job.cancelled = True
            if self._reader.dequeue(job):
                return True
        return job.done.wait(RUNNING_ABORT_WAIT_S)

    def abandon(self) -> None:
        self.job.cancelled = True
        self._reader.dequeue(self.job)


class LocalReader:
    """A thread that runs posted reads in order (see the module docstring).
    Started by the first read; :meth:`close` stops it."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._cond = threading.Condition()
        self._jobs: deque[_Job] = deque()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._maps: set[PeerMap] = set()
        self.reads = 0
        self.bytes = 0
        self.mapped_bytes = 0
        """Of ``bytes``, those copied out of a peer's shared memory."""
        self.failures = 0
        self.denied: set[int] = set()
        """Pids the kernel refused to let this process read (EPERM): read through UCX."""

    def map(self, peer: LocalPeer) -> PeerMap | None:
        """Map the files ``peer`` passed, for :meth:`post` (None: none,
        ``fabric.kv._copy`` not built, or refused: logged, and those reads
        use ``process_vm_readv``)."""
        if not peer.regions or _copier() is None:
            return None
        try:
            pmap = PeerMap(peer.pid, peer.regions, peer.fds)
        except OSError as exc:
            logger.info("pid %d's shared memory is not mapped here: %s", peer.pid, exc)
            return None
        with self._cond:
            if self._closed:
                pmap.unmap()
                return None
            self._maps.add(pmap)
        return pmap

    def unmap(self, pmap: PeerMap) -> None:
        """Unmap ``pmap`` once every read posted before ran."""
        self._queue(_Job(pmap.pid, 0, np.zeros((0, 3), np.int64), pmap, unmap=True))

    def post(
        self, pid: int, start: int, rows: np.ndarray, pmap: PeerMap | None = None
    ) -> LocalRead:
        """Queue a read of Nx3 rows from process ``pid`` (started at ``start``),
        rows already checked against both sides' memory; those in ``pmap``
        are copied out of it."""
        rows = np.asarray(rows, dtype=np.int64).reshape(-1, 3)
        return LocalRead(self, self._queue(_Job(pid, start, rows, pmap)))

    def dequeue(self, job: _Job) -> bool:
        """Take ``job`` off the queue if it has not started; ended aborted."""
        with self._cond:
            try:
                self._jobs.remove(job)
            except ValueError:
                return False
        job.error = "aborted"
        self.failures += 1
        job.done.set()
        return True

    def _queue(self, job: _Job) -> _Job:
        with self._cond:
            if self._closed:
                job.error = "the reader is closed"
                job.done.set()
                return job
            if self._thread is None:
                self._thread = named_thread(
                    self._run, name=f"fabric-local-read-{self.name}", os_name="fabric-lread"
                )
                self._thread.start()
            self._jobs.append(job)
            self._cond.notify()
        return job

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._closed:
                    self._cond.wait()
                if not self._jobs:
                    return
                job = self._jobs.popleft()
            try:
                if job.unmap:
                    self._drop(job.pmap)
                else:
                    self._copy(job)
            except Exception as exc:  # NOTE: one job fails, the thread goes on
                logger.exception("local read from pid %d", job.pid)
                job.error = f"{type(exc).__name__}: {exc}"
            finally:
                if not job.unmap:
                    if job.error is not None:
                        self.failures += 1
                    else:
                        self.reads += 1
                job.done.set()

    def _drop(self, pmap: PeerMap | None) -> None:
        if pmap is not None:
            with self._cond:
                self._maps.discard(pmap)
            pmap.unmap()

    def _copy(self, job: _Job) -> None:
        try:
            alive = _start_time(job.pid) == job.start
        except (FileNotFoundError, ProcessLookupError):
            alive = False
        except (OSError, ValueError, IndexError) as exc:  # NOTE: e.g. no fd left: not a death
            job.error = f"pid {job.pid}: {exc}"
            return
        if not alive:
            # NOTE: a dead peer's memory lives while mapped: let it go now
            self._drop(job.pmap)
            job.error = f"pid {job.pid} is gone or another process now"
            return
        copier = _copier()
        pmap = job.pmap if copier is not None else None
        mapped, rest = pmap.split(job.rows) if pmap is not None else (job.rows[:0], job.rows)
        for rows in calls(mapped):
            if job.cancelled or self._closed:
                job.error = "aborted"
                return
            copier.copy_batch(rows[:, 0].copy(), rows[:, 1].copy(), rows[:, 2].copy(), 1)
            n = int(rows[:, 2].sum())
            job.copied += n
            self.bytes += n
            self.mapped_bytes += n
        for rows in calls(rest):
            if job.cancelled or self._closed:
                job.error = "aborted"
                return
            want = int(rows[:, 2].sum())
            try:
                got = read_rows(job.pid, rows)
            except OSError as exc:
                if exc.errno == errno.EPERM:
                    self.denied.add(job.pid)
                reason = "the peer is gone" if exc.errno == errno.ESRCH else str(exc)
                job.error = f"pid {job.pid}: {reason}"
                return
            job.copied += got
            self.bytes += got
            if got != want:
                job.error = f"pid {job.pid}: {got} of {want} bytes read"
                return
        if len(rest):
            # NOTE: the pid may have named another process by the end (it ended meanwhile)
            try:
                same = _start_time(job.pid) == job.start
            except (OSError, ValueError, IndexError):
                same = False
            if not same:
                job.error = f"pid {job.pid} ended during the read"

    def close(self) -> None:
        """Fail what waits, stop after the running call, join the thread,
        unmap every peer's memory (not if the thread would not stop)."""
        with self._cond:
            self._closed = True
            pending, self._jobs = list(self._jobs), deque()
            self._cond.notify_all()
            thread = self._thread
        for job in pending:
            if job.unmap:
                continue
            job.error = "the reader is closed"
            job.done.set()
        if thread is not None and thread is not threading.current_thread():
            with contextlib.suppress(RuntimeError):
                thread.join(ABORT_WAIT_S)
            if thread.is_alive():
                logger.error(
                    "local reader %s did not stop: its mappings stay, and a copy may still "
                    "write into memory its owner frees",
                    self.name,
                )
                return
        with self._cond:
            maps, self._maps = list(self._maps), set()
        for pmap in maps:
            pmap.unmap()
