"""NIXL/UCX data plane.

The pool is registered once (DRAM now; VRAM when the pool lives on a GPU).
A write is one NIXL WRITE request with one descriptor per segment (NIXL
merges adjacent ones) and the notification attached, so the receiver sees
the message only after every byte landed.

NOTE: NIXL's progress thread busy-polls a core (its Python API hard-codes a
zero delay). It is off by default here: the initiator progresses its writes
through ``check_xfer_state`` (``WriteHandle.poll``) and the receiver calls
``take_notifs`` at a steady rate. Measured in ``benchmarks/transfer.py``.

NIXL agents are not thread-safe in their default sync mode, so every call
into the agent goes through one lock.

A WRITE is one-sided: it lands without the receiver's CPU, which therefore
cannot refuse it (the fence a write names is not checked here). Aborting a
write is releasing its handle (``release_xfer_handle``: NIXL cancels an
active transfer, or refuses and keeps the handle when it cannot); a handle
dropped unfinished is released on the plane's next call, under its lock,
never from a finalizer. The receiver's quarantine covers whatever lands
before the cancel takes effect.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from fabric.errors import FabricError, PeerDisconnected, TransportFailed
from fabric.transfer.dataplane import (
    DataPlane,
    Segment,
    WriteFence,
    WriteHandle,
    XferState,
    spans_within,
)
from fabric.transfer.local_read import (
    LocalClient,
    LocalPeer,
    LocalProcess,
    LocalRead,
    LocalReader,
    LocalServer,
    PeerMap,
    SharedRegion,
    live_regions,
    same_host,
    share_region,
    this_process,
    ucx_allows_local,
)

logger = logging.getLogger(__name__)


class NixlDescriptor(msgspec.Struct, array_like=True, frozen=True):
    """What a peer needs: NIXL agent metadata and where the pool is."""

    metadata: bytes
    pool_base: int
    pool_nbytes: int
    mem_type: str
    device_id: int
    regions: list[tuple[int, int]] = []
    """Memory beyond the pool a peer may READ (base, nbytes): empty in a
    plane's descriptor, filled by its :class:`NixlRegions`."""
    local: LocalProcess | None = None
    """The plane's process, for a reader on its host (host memory only; None
    from an older peer or with local reads off): see
    :mod:`fabric.transfer.local_read`."""


class NixlRegions(msgspec.Struct, array_like=True, frozen=True):
    """A plane's regions for a peer that loaded its descriptor: NIXL partial
    metadata of each registration (no connection info) and the regions."""

    metadata: list[bytes]
    regions: list[tuple[int, int]]
    local_token: bytes = b""
    """Names the plane's connection to a same-host reader's
    :class:`~fabric.transfer.local_read.LocalServer` (empty: none, or an
    older peer)."""


def nixl_available() -> bool:
    """True when the ``nixl`` package imports."""
    try:
        import nixl._api  # noqa: F401
    except Exception:
        return False
    return True


MAX_KEPT_NOTIFS = 4096
"""Notifications ``progress`` keeps for ``take_notifs`` at most (the newest)."""


class _NixlWrite(WriteHandle):
    def __init__(self, plane: NixlDataPlane, handle: Any, state: str) -> None:
        self._plane = plane
        self._handle: Any = handle
        self._state = state

    def poll(self) -> XferState:
        if self._state == "PROC":
            with self._plane.lock:
                self._state = self._plane.agent.check_xfer_state(self._handle)
        if self._state == "ERR":
            return XferState.ERR
        return XferState.DONE if self._state == "DONE" else XferState.PROC

    def release(self) -> None:
        if self._handle is not None:
            with self._plane.lock:
                self._plane.agent.release_xfer_handle(self._handle)
            self._handle = None

    def abort(self) -> bool:
        handle, self._handle = self._handle, None
        if handle is None:
            return True
        if self._state == "PROC":
            self._state = "ERR"  # NOTE: aborted; the plane owns the handle from here
        with self._plane.lock:
            return self._plane.release_handle(handle, warn=True)

    def abandon(self) -> None:
        if self._handle is not None:
            self._plane.orphans.append(self._handle)
            self._handle, self._state = None, "ERR"


class _LocalNixlRead(WriteHandle):
    """A read copied in place (:class:`~fabric.transfer.local_read.LocalRead`),
    then its notification sent as a NIXL one (:meth:`NixlDataPlane.notify`)."""

    def __init__(self, plane: NixlDataPlane, peer: str, read: LocalRead, notif: bytes) -> None:
        self._plane = plane
        self._peer = peer
        self.read = read
        self._notif = notif
        self._sent: WriteHandle | None = None
        self._failed = False

    def poll(self) -> XferState:
        state = self.read.poll()
        if state is not XferState.DONE or not self._notif or self._failed:
            return XferState.ERR if self._failed else state
        if self._sent is None:
            try:
                self._sent = self._plane.notify(self._peer, self._notif)
            except FabricError as exc:
                logger.warning("read of %s: its notification failed: %s", self._peer, exc)
                self._failed = True
                return XferState.ERR
        return self._sent.poll()

    def release(self) -> None:
        if self._sent is not None:
            self._sent.release()

    def abort(self) -> bool:
        ended = self.read.abort()
        if self._sent is not None:
            self._sent.abort()
        return ended

    def abandon(self) -> None:
        self.read.abandon()
        if self._sent is not None:
            self._sent.abandon()


class NixlDataPlane(DataPlane):
    """Data plane over a NIXL agent with the UCX backend.

    ``local_reads``: read a peer of this host in host memory in place
    (:mod:`fabric.transfer.local_read`) rather than through UCX, where
    ``UCX_TLS`` lets UCX do the same."""

    kind = "nixl"
    reads = True

    def __init__(
        self,
        name: str,
        *,
        progress_thread: bool = False,
        ucx_net_devices: str | None = None,
        local_reads: bool = True,
    ) -> None:
        super().__init__(name)
        if ucx_net_devices:
            # UCX reads its environment when the backend is created.
            os.environ["UCX_NET_DEVICES"] = ucx_net_devices
        # NOTE: NIXL logs INFO lines to stdout by default, which corrupts
        # anything that speaks over stdout (test peers, CLI output).
        os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except ImportError as exc:
            raise TransportFailed("nixl is not installed (pip install nixl)") from exc
        config = nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"])
        try:
            self.agent: Any = nixl_agent(name, config)
        except Exception as exc:
            raise TransportFailed(f"could not start NIXL agent {name!r}: {exc}") from exc
        if "UCX" not in self.agent.backends:
            raise TransportFailed("NIXL has no UCX backend on this machine")
        self.lock = threading.Lock()
        self._mem_type = "DRAM"
        self._device_id = 0
        self._reg: Any = None
        self._region_regs: list[Any] = []
        self._regions_md: list[bytes] | None = None  # the regions' metadata, built once
        self._peers: dict[str, NixlDescriptor] = {}
        self._kept: list[tuple[str, bytes]] = []  # notifications progress() took
        # Handles dropped unfinished (appended from any thread, released under the lock).
        self.orphans: deque[Any] = deque()
        self.local_reader = LocalReader(name)
        self._local_server: LocalServer | None = None
        self._local_client: LocalClient | None = None
        if local_reads and ucx_allows_local(os.environ.get("UCX_TLS")):
            try:
                self._local_server = LocalServer(name, self._local_gone)
                self._local_client = LocalClient()
            except OSError as exc:
                logger.info("no same-host reads: %s", exc)
        address = self._local_server.address if self._local_server is not None else ""
        self._me = this_process(address) if self._local_server is not None else None
        self._local_lock = threading.Lock()
        self._local_peers: dict[str, LocalPeer] = {}
        self._peer_maps: dict[str, PeerMap] = {}
        self._peer_tokens: dict[str, bytes] = {}
        self._unlinked: set[str] = set()  # peers a link to failed (until their next descriptor)
        self._shared: list[SharedRegion] = []

    def _register(self, base_address: int, nbytes: int, device: str) -> None:
        if device.startswith("cuda"):
            self._mem_type = "VRAM"
            self._device_id = int(device.partition(":")[2] or 0)
        with self.lock:
            reg = self.agent.register_memory(
                [(base_address, nbytes, self._device_id, "")], self._mem_type
            )
        if reg is None:
            raise TransportFailed(f"NIXL refused to register {nbytes} bytes of {device}")
        self._reg = reg

    def _register_region(self, base_address: int, nbytes: int, device: str) -> None:
        """NOTE: the trust boundary. NIXL does not limit a registration to
        reads: every agent that loaded this plane's :meth:`region_descriptor`
        can READ and WRITE all of a registered region. :meth:`descriptor`
        (which every Hello carries, before its answer is checked) holds the
        pool's registration only; the region descriptor goes in Offers, to
        peers that answered the Hello (signed beyond loopback). A peer's own
        checks (:meth:`~fabric.transfer.dataplane.DataPlane.check_read`)
        protect it, not the side being read.
        """
        mem_type = "VRAM" if device.startswith("cuda") else "DRAM"
        device_id = int(device.partition(":")[2] or 0) if mem_type == "VRAM" else 0
        if (mem_type, device_id) != (self._mem_type, self._device_id):
            # NOTE: one memory kind per transfer side; a cache on a GPU beside
            # a host pool is not supported by the direct path yet
            raise TransportFailed(
                f"direct transfers need the cache ({device}) in the pool's memory "
                f"({self._mem_type} {self._device_id})"
            )
        if self._me is not None and mem_type == "DRAM":
            # NOTE: before NIXL registers (pins) the pages, which it replaces
            shared = share_region(base_address, nbytes)
            if shared is not None and shared not in self._shared:
                self._shared.append(shared)
                if self._local_client is not None:
                    # NOTE: registered() gains this region only once this returns
                    readable = [*self.registered(), (base_address, nbytes)]
                    self._local_client.update(self._live_shared(), readable)
        with self.lock:
            try:
                reg = self.agent.register_memory([(base_address, nbytes, device_id, "")], mem_type)
            except Exception as exc:
                raise TransportFailed(f"NIXL refused to register {nbytes} bytes: {exc}") from exc
            if reg is None:
                raise TransportFailed(f"NIXL refused to register {nbytes} bytes of {device}")
            self._region_regs.append(reg)
            self._regions_md = None

    def descriptor(self) -> bytes:
        """The agent's connection info and the pool's registration only
        (NIXL partial metadata): a peer that loads it cannot reach the
        regions (the cache), whose keys only :meth:`region_descriptor` holds."""
        with self.lock:
            if self._reg is None:
                # NOTE: no pool, so no region either (the pool comes first)
                metadata = self.agent.get_agent_metadata()
            else:
                metadata = self.agent.get_partial_agent_metadata(self._reg, True, ["UCX"])
        me = self._me if self._mem_type == "DRAM" else None
        info = NixlDescriptor(
            metadata, self.pool_base, self.pool_nbytes, self._mem_type, self._device_id, [], me
        )
        return msgspec.msgpack.encode(info)

    def region_descriptor(self, peer: str | None = None) -> bytes:
        """The regions' registrations, and for ``peer`` the token of this
        plane's same-host link to it (a token per peer: one peer's cannot
        name another's link)."""
        with self.lock:
            if self._regions_md is None:
                metadata = [
                    self.agent.get_partial_agent_metadata(reg, False, ["UCX"])
                    for reg in self._region_regs
                ]
                self._regions_md = metadata
            metadata = list(self._regions_md)
        token = self._link(peer) if peer is not None else b""
        return msgspec.msgpack.encode(NixlRegions(metadata, list(self.regions), token))

    def _live_shared(self) -> list[SharedRegion]:
        """This plane's shared regions whose memory is still there (a freed
        cache's file is closed, and its number may name another file)."""
        self._shared = live_regions(self._shared)
        return self._shared

    def _link(self, peer: str) -> bytes:
        """The token of this plane's same-host link to ``peer``, linking first
        (empty: none). Made on the first region descriptor for it (an
        Offer: never for a peer that did not answer this side's Hello), so
        no other process is handed this plane's shared memory."""
        client, info = self._local_client, self._peers.get(peer)
        if client is None or info is None or peer in self._unlinked:
            return b""
        if not client.linked(peer):
            self._unlinked.add(peer)  # NOTE: tried once per descriptor loaded, not per Offer
            there = info.local
            if (
                there is None
                or not there.socket
                or info.mem_type != "DRAM"
                or not same_host(there, self._me)
                or not client.connect(
                    peer,
                    there.socket,
                    self._live_shared(),
                    sender=self.name,
                    readable=self.registered(),
                )
            ):
                return b""
            logger.debug("NIXL peer %s: same-host link up", peer)
            self._unlinked.discard(peer)
        return client.token_for(peer)

    def add_regions(self, peer: str, descriptor: bytes) -> None:
        info = self._peer(peer)
        try:
            given = msgspec.msgpack.decode(descriptor, type=NixlRegions)
        except msgspec.DecodeError as exc:
            raise TransportFailed(f"bad NIXL region descriptor: {exc}") from exc
        if len(given.metadata) != len(given.regions):
            # NOTE: ranges with no registration of their own would name
            # sections another descriptor loaded for this agent
            raise TransportFailed(
                f"{len(given.regions)} regions with {len(given.metadata)} registrations"
            )
        for metadata in given.metadata:
            name = self._load(metadata, "region descriptor")
            if name != peer:
                raise TransportFailed(f"regions of {name!r} offered as {peer!r}'s")
        regions = [(int(b), int(n)) for b, n in given.regions]
        self._peers[peer] = msgspec.structs.replace(info, regions=regions)
        with self._local_lock:
            # NOTE: an empty token (no link, an older peer) unbinds the name too
            self._peer_tokens[peer] = given.local_token

    def add_peer(self, descriptor: bytes) -> str:
        try:
            info = msgspec.msgpack.decode(descriptor, type=NixlDescriptor)
        except msgspec.DecodeError as exc:
            raise TransportFailed(f"bad NIXL peer descriptor: {exc}") from exc
        name = self._load(info.metadata, "peer descriptor")
        prev = self._peers.get(name)
        self._peers[name] = info
        if prev is None or (prev.metadata, prev.local) != (info.metadata, info.local):
            self._forget_local(name)  # NOTE: another process under that name: links anew
        return name

    def _local_peer(self, peer: str) -> LocalPeer | None:
        """``peer`` as its same-host link proved it (its memory mapped here
        on first use); None: read through UCX."""
        server = self._local_server
        if server is None:
            return None
        with self._local_lock:
            token = self._peer_tokens.get(peer)
            found = self._local_peers.get(peer)
            if found is not None and found.alive and found.token == token:
                return found
            found = server.peer(token) if token else None
            if found is None or found.sender != peer:
                # NOTE: a link is its sender's only: another agent's token names nothing here
                self._local_peers.pop(peer, None)
                return None
            self._local_peers[peer] = found
            stale = self._peer_maps.pop(peer, None)
            pmap = self.local_reader.map(found)
            if pmap is not None:
                self._peer_maps[peer] = pmap
        if stale is not None:
            self.local_reader.unmap(stale)
        return found

    def _local_gone(self, gone: LocalPeer) -> None:
        """A same-host link closed (the peer exited or went away): let its
        memory go (:class:`~fabric.transfer.local_read.LocalServer`'s thread)."""
        with self._local_lock:
            names = [name for name, p in self._local_peers.items() if p is gone]
            maps = [self._peer_maps.pop(name, None) for name in names]
            for name in names:
                del self._local_peers[name]
        for pmap in maps:
            if pmap is not None:
                self.local_reader.unmap(pmap)

    def _forget_local(self, peer: str) -> None:
        self._unlinked.discard(peer)
        with self._local_lock:
            self._local_peers.pop(peer, None)
            self._peer_tokens.pop(peer, None)
            pmap = self._peer_maps.pop(peer, None)
        if pmap is not None:
            self.local_reader.unmap(pmap)
        if self._local_client is not None:
            self._local_client.drop(peer)

    def _load(self, metadata: bytes, what: str) -> str:
        """Load NIXL metadata (whole or partial); the agent it names."""
        try:
            with self.lock:
                name = self.agent.add_remote_agent(metadata)
        except Exception as exc:
            raise TransportFailed(f"bad NIXL {what}: {exc}") from exc
        return name.decode() if isinstance(name, bytes) else str(name)

    def remove_peer(self, peer: str) -> None:
        self._forget_local(peer)
        if self._peers.pop(peer, None) is not None:
            with self.lock:
                self.agent.remove_remote_agent(peer)

    def peer_count(self) -> int:
        return len(self._peers)

    def counters(self) -> dict[str, int]:
        """``local_reads`` / ``local_read_failures``: reads of a peer of this
        host done in place; ``local_bytes``: their bytes, ``mapped_bytes`` of
        them copied out of the peer's shared memory; ``local_peers`` /
        ``mapped_peers``: peers read in place now, and with their memory
        mapped; ``shared_bytes``: this plane's own memory shared with readers
        of its host (:mod:`fabric.transfer.local_read`)."""
        r = self.local_reader
        return {
            "local_reads": r.reads,
            "local_read_failures": r.failures,
            "local_bytes": r.bytes,
            "mapped_bytes": r.mapped_bytes,
            "local_refused": self._local_server.refused if self._local_server else 0,
            "local_peers": len(self._local_peers),
            "mapped_peers": len(self._peer_maps),
            "shared_bytes": sum(s.nbytes for s in self._shared),
        }

    def post_write(
        self,
        peer: str,
        segments: Sequence[Segment],
        notif: bytes,
        fence: WriteFence | None = None,
    ) -> WriteHandle:
        info = self._peer(peer)
        self.check_segments(segments, info.pool_nbytes)
        return self._post(peer, info, np.asarray(segments, dtype=np.uint64).reshape(-1, 3), notif)

    def post_read(self, peer: str, spans: np.ndarray, notif: bytes = b"") -> WriteHandle:
        info = self._peer(peer)
        rows = self.check_read(peer, spans, [(info.pool_base, info.pool_nbytes), *info.regions])
        same = self._local_peer(peer) if self._mem_type == "DRAM" else None
        if (
            same is not None
            and same.pid not in self.local_reader.denied
            # NOTE: in place only what the sender itself let this process read
            # over its link; other claimed ranges go to NIXL, whose keys bound them
            and spans_within(rows[:, 1], rows[:, 2], same.readable)
        ):
            pmap = self._peer_maps.get(peer)
            read = self.local_reader.post(same.pid, same.start, rows, pmap)
            return _LocalNixlRead(self, peer, read, notif)
        local = np.empty((len(rows), 3), dtype=np.uint64)
        remote = np.empty((len(rows), 3), dtype=np.uint64)
        local[:, 0], remote[:, 0] = rows[:, 0], rows[:, 1]
        local[:, 1] = remote[:, 1] = rows[:, 2]
        local[:, 2], remote[:, 2] = self._device_id, info.device_id
        return self._xfer("READ", peer, info, local, remote, notif)

    def notify(self, peer: str, notif: bytes) -> WriteHandle:
        # NOTE: a zero-length WRITE carrying the notification, rather than
        # send_notif: the sender progresses it like any write (send_notif is
        # untracked, and with the progress thread off it can sit unsent).
        info = self._peer(peer)
        return self._post(peer, info, np.zeros((1, 3), dtype=np.uint64), notif)

    def _peer(self, peer: str) -> NixlDescriptor:
        info = self._peers.get(peer)
        if info is None:
            raise PeerDisconnected(f"unknown NIXL peer {peer!r}")
        return info

    def _post(self, peer: str, info: NixlDescriptor, seg: np.ndarray, notif: bytes) -> WriteHandle:
        """One WRITE of ``seg`` rows (local offset, remote offset, nbytes)."""
        local = np.empty((len(seg), 3), dtype=np.uint64)
        remote = np.empty((len(seg), 3), dtype=np.uint64)
        local[:, 0] = seg[:, 0] + np.uint64(self.pool_base)
        remote[:, 0] = seg[:, 1] + np.uint64(info.pool_base)
        local[:, 1] = remote[:, 1] = seg[:, 2]
        local[:, 2] = self._device_id
        remote[:, 2] = info.device_id
        return self._xfer("WRITE", peer, info, local, remote, notif)

    def _xfer(
        self,
        op: str,
        peer: str,
        info: NixlDescriptor,
        local: np.ndarray,
        remote: np.ndarray,
        notif: bytes,
    ) -> WriteHandle:
        """Post one ``op`` (WRITE or READ) of Nx3 address rows."""
        with self.lock:
            self._release_orphans()
            handle = None
            try:
                local_descs = self.agent.get_xfer_descs(local, self._mem_type)
                remote_descs = self.agent.get_xfer_descs(remote, info.mem_type)
                handle = self.agent.initialize_xfer(op, local_descs, remote_descs, peer, notif)
                state = self.agent.transfer(handle)
            except Exception as exc:
                if handle is not None:  # NOTE: created, not posted: nothing runs on it
                    self.release_handle(handle)
                if _disconnected(exc):
                    raise PeerDisconnected(f"NIXL peer {peer!r} is disconnected: {exc}") from exc
                raise TransportFailed(f"NIXL {op.lower()} with {peer!r} failed: {exc}") from exc
        return _NixlWrite(self, handle, state)

    def release_handle(self, handle: Any, *, warn: bool = False) -> bool:
        """Release (and so cancel, if still active) ``handle``; the lock is held.

        False when NIXL could not cancel it: the handle is kept (in
        ``orphans``) and released again on a later call.
        """
        try:
            self.agent.release_xfer_handle(handle)
        except Exception as exc:
            log = logger.warning if warn else logger.debug
            log("NIXL could not cancel a write yet (retried later): %s", exc)
            self.orphans.append(handle)
            return False
        return True

    def _release_orphans(self) -> None:
        for _ in range(len(self.orphans)):
            self.release_handle(self.orphans.popleft())

    def holds_handles(self) -> bool:
        return bool(self.orphans)

    def take_notifs(self) -> list[tuple[str, bytes]]:
        with self.lock:
            self._release_orphans()
            notifs = self.agent.get_new_notifs()
            kept, self._kept = self._kept, []
        return kept + [(peer, msg) for peer, msgs in notifs.items() for msg in msgs]

    def progress(self) -> None:
        # NOTE: NIXL's progress call is the notification poll; what it
        # returns is kept for the owner of take_notifs (the server)
        with self.lock:
            notifs = self.agent.get_new_notifs()
            self._kept.extend((peer, msg) for peer, msgs in notifs.items() for msg in msgs)
            # NOTE: a node with no server never takes them: keep the newest few
            del self._kept[:-MAX_KEPT_NOTIFS]

    def close(self) -> None:
        # NOTE: first: no copy may land in memory deregistered (and freed) below
        if self._local_client is not None:
            self._local_client.close()
        if self._local_server is not None:
            self._local_server.close()
        self.local_reader.close()
        with self.lock:
            self._release_orphans()
            self._local_peers.clear()
            self._peer_maps.clear()
            self._peer_tokens.clear()
            for peer in list(self._peers):
                self.agent.remove_remote_agent(peer)
            self._peers.clear()
            if self._reg is not None:
                self.agent.deregister_memory(self._reg)
                self._reg = None
            for reg in self._region_regs:
                self.agent.deregister_memory(reg)
            self._region_regs.clear()
            self.regions.clear()


def _disconnected(exc: Exception) -> bool:
    """Whether NIXL refused a write because its remote agent is disconnected
    (``nixlRemoteDisconnectError``, ``NIXL_ERR_REMOTE_DISCONNECT``)."""
    return type(exc).__name__ == "nixlRemoteDisconnectError" or "REMOTE_DISCONNECT" in str(exc)
