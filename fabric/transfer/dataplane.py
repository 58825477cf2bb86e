"""Data plane interface: one-sided WRITEs of pool bytes plus a notification.

A data plane belongs to one process. It registers the process's chunk pool
once, describes itself to peers as opaque bytes (``descriptor()``), and
moves lists of segments from the local pool into a peer's pool:

    local pool                       remote pool
    +------+------+------+           +------+------+------+------+
    | s0   | s1   | s2   |  WRITE    |      | r7   | r8   |      |
    +------+------+------+  ------>  +------+------+------+------+
      (local_offset, remote_offset, nbytes) per segment, one notification
      delivered to the receiver after all segments landed.

The receiver learns of a completed write only through ``take_notifs()``; a
write posted with an empty notification (fault injection) delivers none, and
``notify`` sends a notification without a write.
Implementations: NIXL/UCX (``nixl_plane``), TCP (``tcp_plane``) and the
in-process :class:`LoopbackDataPlane` for fast unit tests.

Fencing: a write names the reservation it is for (:class:`WriteFence`: the
request id and each segment's target slot and generation). A plane that
sees writes arrive (``fences_writes``: TCP, loopback) hands the fence to
the receiver's :class:`WriteGuard` before a byte lands; a refused write's
bytes are drained unwritten and its notification dropped (it would vouch
for bytes that never landed). A one-sided RDMA write (NIXL) reaches memory
without the receiver's CPU, so there the sender aborts what outlives its
timeout (:meth:`WriteHandle.abort`) and the receiver quarantines slots.
"""

from __future__ import annotations

import ctypes
import enum
import threading
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Sequence
from typing import ClassVar

import msgspec
import numpy as np

from fabric.errors import TransportFailed
from fabric.store.pool import HOST_DEVICES

Segment = tuple[int, int, int]
"""(local_offset, remote_offset, nbytes) in bytes from each pool's base."""


def drain(queue: deque[tuple[str, bytes]]) -> list[tuple[str, bytes]]:
    """Pop everything from ``queue`` (appended to by other threads)."""
    out = []
    while queue:
        out.append(queue.popleft())
    return out


class WriteFence(msgspec.Struct, array_like=True, frozen=True):
    """The reservation a write is for: segment ``i`` lands in ``slots[i]``,
    which the receiver handed out at ``generations[i]``."""

    request_id: str
    slots: list[int]
    generations: list[int]


class WriteTicket(ABC):
    """An admitted write; ``end()`` once its last byte landed (or it broke off)."""

    @abstractmethod
    def end(self) -> None: ...


class WriteGuard(ABC):
    """The receiver's check of each incoming write, before a byte of it lands."""

    @abstractmethod
    def admit(
        self, peer: str, fence: WriteFence | None, segments: Sequence[tuple[int, int]]
    ) -> WriteTicket | None:
        """A ticket for a write of ``segments`` (remote offset, nbytes) from
        ``peer``; None to refuse it (the guard counts and logs why)."""


class _NoTicket(WriteTicket):
    def end(self) -> None:
        pass


ADMITTED: WriteTicket = _NoTicket()
"""The ticket of a plane nobody guards: every write is admitted."""


class XferState(enum.Enum):
    """State of a posted write, as the initiator sees it."""

    PROC = "proc"
    DONE = "done"
    ERR = "err"


class WriteHandle(ABC):
    """A posted write. ``poll()`` also drives progress where the plane needs it."""

    @abstractmethod
    def poll(self) -> XferState: ...

    def release(self) -> None:  # noqa: B027 - optional hook
        """Free transport resources of a finished write."""

    def abort(self) -> bool:
        """Stop the write if it still runs and free its resources.

        True when no byte of it can land any more (it ended, or was stopped
        in time); False when some still may: the receiver's quarantine (or
        its guard) covers those. Planes whose writes end when posted keep
        this default.
        """
        ended = self.poll() is not XferState.PROC
        self.release()
        return ended

    def abandon(self) -> None:
        """Its owner dropped it unfinished: stop it without blocking (``__del__`` path)."""
        self.abort()


class DataPlane(ABC):
    """One process's end of the data plane."""

    kind: ClassVar[str]
    fences_writes: ClassVar[bool] = False
    """Whether writes into this plane pass its :class:`WriteGuard` first."""
    reads: ClassVar[bool] = False
    """Whether :meth:`post_read` works (NIXL, loopback)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.pool_base = 0
        self.pool_nbytes = 0
        self.regions: list[tuple[int, int]] = []
        self.write_guard: WriteGuard | None = None

    def set_write_guard(self, guard: WriteGuard | None) -> None:
        """Check incoming writes with ``guard`` (None: admit all), where the plane can."""
        self.write_guard = guard

    def admit(
        self, peer: str, fence: WriteFence | None, segments: Sequence[tuple[int, int]]
    ) -> WriteTicket | None:
        """The guard's verdict on an incoming write (admitted when there is none)."""
        guard = self.write_guard
        if guard is None or not segments:  # NOTE: a bare notification writes nothing
            return ADMITTED
        return guard.admit(peer, fence, segments)

    def register_pool(self, base_address: int, nbytes: int, device: str = "cpu") -> None:
        """Register the chunk pool once; every write reads from or lands in it."""
        if self.pool_nbytes:
            raise TransportFailed(f"{self.kind}: pool already registered")
        self._register(base_address, nbytes, device)
        # NOTE: after: a pool that did not register lets no region register
        self.pool_base, self.pool_nbytes = base_address, nbytes

    @abstractmethod
    def _register(self, base_address: int, nbytes: int, device: str) -> None: ...

    @abstractmethod
    def descriptor(self) -> bytes:
        """Opaque bytes a peer passes to ``add_peer`` to reach this plane."""

    @abstractmethod
    def add_peer(self, descriptor: bytes) -> str:
        """Load a peer's descriptor; returns the peer name used in ``post_write``."""

    @abstractmethod
    def post_write(
        self,
        peer: str,
        segments: Sequence[Segment],
        notif: bytes,
        fence: WriteFence | None = None,
    ) -> WriteHandle:
        """Start writing ``segments`` to ``peer`` and notify it when all landed.

        ``fence`` names the reservation the write is for; a receiver that
        guards its pool refuses a write of segments without one.
        """

    def notify(self, peer: str, notif: bytes) -> WriteHandle:
        """Send ``notif`` to ``peer`` without writing any bytes."""
        return self.post_write(peer, [], notif)

    def register_region(self, base_address: int, nbytes: int, device: str = "cpu") -> None:
        """Register memory beyond the pool (a paged KV cache) for direct
        transfers (:meth:`post_read`). :meth:`descriptor` never names it (it
        goes to every peer that asks for a Hello): a peer learns of it from
        :meth:`region_descriptor`, which is sent only to peers that passed
        the Hello (with an ``Offer``)."""
        if not self.pool_nbytes:
            raise TransportFailed("register the pool before any other region")
        if nbytes <= 0:
            raise TransportFailed(f"cannot register {nbytes} bytes")
        if any(b < base_address + nbytes and base_address < b + n for b, n in self.registered()):
            raise TransportFailed("the region overlaps memory already registered")
        self._register_region(base_address, nbytes, device)
        self.regions.append((base_address, nbytes))

    def _register_region(self, base_address: int, nbytes: int, device: str) -> None:
        raise TransportFailed(f"{self.kind}: this data plane cannot move caches directly")

    def region_descriptor(self, peer: str | None = None) -> bytes:
        """Opaque bytes a peer that loaded :meth:`descriptor` passes to
        :meth:`add_regions` to READ the regions registered here; ``peer``:
        the one it goes to (its name here), for what only it may know."""
        raise TransportFailed(f"{self.kind}: this data plane cannot move caches directly")

    def add_regions(self, peer: str, descriptor: bytes) -> None:
        """Load ``peer``'s :meth:`region_descriptor`: its regions may be read from now on."""
        raise TransportFailed(f"{self.kind}: this data plane cannot move caches directly")

    def registered(self) -> list[tuple[int, int]]:
        """The pool and every region, as (base, nbytes)."""
        return [(self.pool_base, self.pool_nbytes), *self.regions]

    def post_read(self, peer: str, spans: np.ndarray, notif: bytes = b"") -> WriteHandle:
        """Start reading ``spans`` from ``peer``: Nx3 rows (local address,
        remote address, nbytes), each inside a region (or the pool) of its
        side; ``poll()`` says when every byte arrived. ``notif`` reaches the
        peer after the read."""
        raise TransportFailed(f"{self.kind}: this data plane cannot move caches directly")

    def check_read(
        self, peer: str, spans: np.ndarray, remote: Sequence[tuple[int, int]]
    ) -> np.ndarray:
        """``spans`` as Nx3 int64 rows, refused unless each lands in this
        plane's registered memory and takes bytes from ``peer``'s (``remote``)."""
        rows = np.asarray(spans, dtype=np.int64).reshape(-1, 3)
        if not spans_within(rows[:, 0], rows[:, 2], self.registered()):
            raise TransportFailed("a read lands outside this process's registered memory")
        if not spans_within(rows[:, 1], rows[:, 2], remote):
            raise TransportFailed(f"a read takes bytes outside what {peer!r} registered")
        return rows

    @abstractmethod
    def take_notifs(self) -> list[tuple[str, bytes]]:
        """Drain notifications received so far as (peer name, message)."""

    def progress(self) -> None:  # noqa: B027 - optional hook
        """Drive the transport once (a peer's READ of this process's memory
        may need it), keeping any notification for ``take_notifs``."""

    def holds_handles(self) -> bool:
        """Whether handles wait to be released by a later ``take_notifs``
        (NIXL's that could not be released at once)."""
        return False

    def remove_peer(self, peer: str) -> None:  # noqa: B027 - optional hook
        """Forget a peer."""

    def peer_count(self) -> int:
        """Peers this plane keeps state for (connections, loaded metadata)."""
        return 0

    def counters(self) -> dict[str, int]:
        """The plane's own counters (monotonic), for a server's ``Stats``."""
        return {}

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release registrations, sockets and threads."""

    def check_segments(self, segments: Sequence[Segment], remote_nbytes: int) -> None:
        """Refuse segments that fall outside either pool."""
        for local, remote, nbytes in segments:
            if nbytes <= 0 or local < 0 or remote < 0:
                raise TransportFailed(f"bad segment {(local, remote, nbytes)}")
            if local + nbytes > self.pool_nbytes or remote + nbytes > remote_nbytes:
                raise TransportFailed(f"segment {(local, remote, nbytes)} outside a pool")


def spans_within(
    addrs: np.ndarray, lengths: np.ndarray, regions: Sequence[tuple[int, int]]
) -> bool:
    """Whether every span (address, nbytes > 0) lies inside one of ``regions``
    (base, nbytes), none of which overlap."""
    if not len(addrs):
        return True
    if not regions:
        return False
    table = np.asarray(sorted(regions), dtype=np.int64).reshape(-1, 2)
    addrs = np.asarray(addrs, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    if (table[:, 1] <= 0).any():
        return False
    at = np.searchsorted(table[:, 0], addrs, side="right") - 1
    ok = (lengths > 0) & (at >= 0)
    at = np.maximum(at, 0)
    # NOTE: no addr + length (it can wrap): the span's room left in its region
    ok &= lengths <= table[at, 0] + table[at, 1] - addrs
    return bool(ok.all())


class PoolInfo(msgspec.Struct, array_like=True, frozen=True):
    """Descriptor of the loopback plane: a name in the process registry."""

    name: str
    nbytes: int


class RegionInfo(msgspec.Struct, array_like=True, frozen=True):
    """Region descriptor of the loopback plane: its regions, by name."""

    name: str
    regions: list[tuple[int, int]]


class DoneWrite(WriteHandle):
    """A write that completed when it was posted."""

    def poll(self) -> XferState:
        return XferState.DONE


class LoopbackDataPlane(DataPlane):
    """In-process data plane: writes are memmoves, notifications a deque.

    Several planes in one process reach each other by name, as agents in
    different processes do over NIXL. For unit tests and single-process use.
    """

    kind = "loopback"
    fences_writes = True
    reads = True
    _registry: ClassVar[dict[str, LoopbackDataPlane]] = {}
    _registry_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._notifs: deque[tuple[str, bytes]] = deque()
        self._peer_regions: dict[str, list[tuple[int, int]]] = {}  # given by add_regions
        with self._registry_lock:
            if name in self._registry:
                raise TransportFailed(f"loopback plane {name!r} exists")
            self._registry[name] = self

    def _register(self, base_address: int, nbytes: int, device: str) -> None:
        if device not in HOST_DEVICES:
            raise TransportFailed("loopback plane moves host memory only")

    def descriptor(self) -> bytes:
        return msgspec.msgpack.encode(PoolInfo(self.name, self.pool_nbytes))

    def add_peer(self, descriptor: bytes) -> str:
        info = msgspec.msgpack.decode(descriptor, type=PoolInfo)
        if info.name not in self._registry:
            raise TransportFailed(f"no loopback plane {info.name!r}")
        self._peer_regions.pop(info.name, None)  # NOTE: as NIXL's: loaded anew from Offers
        return info.name

    def post_write(
        self,
        peer: str,
        segments: Sequence[Segment],
        notif: bytes,
        fence: WriteFence | None = None,
    ) -> WriteHandle:
        target = self._registry.get(peer)
        if target is None:
            raise TransportFailed(f"loopback peer {peer!r} is gone")
        self.check_segments(segments, target.pool_nbytes)
        ticket = target.admit(self.name, fence, [(r, n) for _, r, n in segments])
        if ticket is None:
            return DoneWrite()  # NOTE: refused, notification and all, as over TCP
        try:
            for local, remote, nbytes in segments:
                ctypes.memmove(target.pool_base + remote, self.pool_base + local, nbytes)
        finally:
            ticket.end()
        if notif:
            target._notifs.append((self.name, notif))
        return DoneWrite()

    def _register_region(self, base_address: int, nbytes: int, device: str) -> None:
        if device not in HOST_DEVICES:
            raise TransportFailed("loopback plane moves host memory only")

    def region_descriptor(self, peer: str | None = None) -> bytes:
        return msgspec.msgpack.encode(RegionInfo(self.name, list(self.regions)))

    def add_regions(self, peer: str, descriptor: bytes) -> None:
        try:
            info = msgspec.msgpack.decode(descriptor, type=RegionInfo)
        except msgspec.DecodeError as exc:
            raise TransportFailed(f"bad loopback region descriptor: {exc}") from exc
        if info.name != peer:
            raise TransportFailed(f"regions of {info.name!r} offered as {peer!r}'s")
        source = self._registry.get(peer)
        if source is None or not set(map(tuple, info.regions)) <= set(source.regions):
            raise TransportFailed(f"{peer!r} registered no such regions")
        self._peer_regions[peer] = [(int(b), int(n)) for b, n in info.regions]

    def post_read(self, peer: str, spans: np.ndarray, notif: bytes = b"") -> WriteHandle:
        source = self._registry.get(peer)
        if source is None:
            raise TransportFailed(f"loopback peer {peer!r} is gone")
        # NOTE: as over NIXL: only what this side was given (the pool, and
        # the regions of a region descriptor)
        given = [(source.pool_base, source.pool_nbytes), *self._peer_regions.get(peer, [])]
        rows = self.check_read(peer, spans, given)
        for local, far, nbytes in rows.tolist():
            ctypes.memmove(local, far, nbytes)
        if notif:
            source._notifs.append((self.name, notif))
        return DoneWrite()

    def take_notifs(self) -> list[tuple[str, bytes]]:
        return drain(self._notifs)

    def close(self) -> None:
        with self._registry_lock:
            self._registry.pop(self.name, None)
