"""TCP data plane: the fallback where NIXL is not installed.

Same contract as NIXL: the sender names segments of its pool and of the
receiver's pool; the receiver copies the bytes straight from the socket
into its pool (``recv_into``, no staging) and queues the notification after
the last byte. One connection per (sender, receiver) pair, written by one
sender thread, read by one receiver thread. Frame on the wire:

    u32 header_len | header (msgpack TcpWrite) | [tag] | payload of every segment | [payload tag]

(the tags only with a secret)

With a shared secret the header is followed by its HMAC-SHA256 tag (32 B),
checked before the header is decoded, so only a peer holding the secret
can place bytes in the pool, and the payload by a second tag: HMAC-SHA256,
keyed with the secret, over the header's tag and then every payload byte
(computed in ``PIECE_BYTES`` pieces as they are sent and received). A
payload whose tag does not match (bytes changed in transit) drops the
connection and its notification: the bytes landed in the slots the write
was admitted to, but nothing vouches for them, so the reservation is never
filled with them. The receiver checks every segment against its
pool bounds before reading the payload; a frame that fails a check closes
the connection. The header carries the write's
:class:`~fabric.transfer.dataplane.WriteFence`; the receiver's guard admits
the write against its live reservations before a byte is copied into the
pool, and holds the slots while the payload arrives. A refused write's
payload is read and dropped (the connection stays in step), and so is its
notification.

Peers are independent: each has its own connection and send thread, so a
peer that stops reading stalls only the writes queued to it. Every socket
operation is bounded: a connect by ``CONNECT_TIMEOUT_S``, each send or
receive by ``IO_TIMEOUT_S`` (a write whose bytes stop moving fails), and
idle connections are probed by TCP keepalive. A failed connect fails the
writes that start within ``RETRY_S`` after it at once rather than each
waiting out its own connect. ``remove_peer`` stops the peer's thread; the
writes still queued to it that have not started fail at once. ``close``
waits ``CLOSE_TIMEOUT_S`` in all for the send threads to end.
"""

from __future__ import annotations

import contextlib
import ctypes
import hmac
import logging
import queue
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Sequence

import msgspec

from fabric.errors import TransportFailed
from fabric.store.pool import HOST_DEVICES
from fabric.threads import thread as named_thread
from fabric.transfer.addresses import advertised_host, bind_host
from fabric.transfer.dataplane import (
    DataPlane,
    Segment,
    WriteFence,
    WriteHandle,
    WriteTicket,
    XferState,
    drain,
)

logger = logging.getLogger(__name__)

_LEN = struct.Struct("<I")
_MAX_HEADER = 16 << 20
_TAG_BYTES = 32
_DRAIN_BYTES = 1 << 20
PIECE_BYTES = 1 << 20
"""Payload pieces hashed and moved together while a secret is set (cache-sized)."""


class TcpDescriptor(msgspec.Struct, array_like=True, frozen=True):
    name: str
    host: str
    port: int
    pool_nbytes: int


class TcpWrite(msgspec.Struct, array_like=True, frozen=True):
    sender: str
    remote_segments: list[tuple[int, int]]
    notif: bytes
    fence: WriteFence | None = None


class _TcpWriteHandle(WriteHandle):
    def __init__(self) -> None:
        self.done = threading.Event()
        self.failed = False
        self.lock = threading.Lock()
        self.started = self.cancelled = False

    def poll(self) -> XferState:
        if not self.done.is_set():
            return XferState.PROC
        return XferState.ERR if self.failed else XferState.DONE

    def start(self) -> bool:
        """The sender thread takes the job: False if it was aborted first."""
        with self.lock:
            self.started = not self.cancelled
            return self.started

    def abort(self) -> bool:
        # NOTE: a frame already on the wire is not cut short: the receiver
        # admitted it against a live reservation and holds its slots meanwhile.
        with self.lock:
            if not self.started:
                self.cancelled = self.failed = True
                self.done.set()
            return self.done.is_set()


Job = tuple[Sequence[Segment], bytes, WriteFence | None, _TcpWriteHandle]


# NOTE: a peer that stops mid-write (dead without a RST, partitioned) must
# not hold a slot or a send thread for ever: a write's bytes must keep moving
# within IO_TIMEOUT_S, and idle connections are probed by TCP keepalive.
IO_TIMEOUT_S = 30.0
CONNECT_TIMEOUT_S = 5.0
RETRY_S = 1.0
CLOSE_TIMEOUT_S = 5.0  # for all the send threads together, however many peers
_KEEPALIVE = (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3))


def keep_alive(sock: socket.socket) -> None:
    """Turn TCP keepalive on, with short probes where the platform has them."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in _KEEPALIVE:
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    while view.nbytes:
        n = sock.recv_into(view)
        if n == 0:
            raise ConnectionError("peer closed the connection")
        view = view[n:]


def _drain(sock: socket.socket, nbytes: int) -> None:
    """Read and drop ``nbytes`` (a refused write's payload), in bounded pieces."""
    scratch = memoryview(bytearray(min(nbytes, _DRAIN_BYTES)))
    while nbytes:
        piece = min(nbytes, len(scratch))
        _recv_exact(sock, scratch[:piece])
        nbytes -= piece


class _PeerSender:
    """One outgoing connection and the thread that writes to it, in order."""

    def __init__(self, plane: TcpDataPlane, info: TcpDescriptor) -> None:
        self.plane, self.info = plane, info
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.sock: socket.socket | None = None
        self.stopping = False
        self._connect_failed_at = -RETRY_S
        self.thread = named_thread(self._run, name=f"tcp-send-{info.name}", os_name="tcp-send")
        self.thread.start()

    def stop(self) -> None:
        """End the thread; queued writes that have not started fail at once."""
        self.stopping = True
        self.jobs.put(None)

    def _connect(self) -> socket.socket:
        if time.monotonic() - self._connect_failed_at < RETRY_S:
            raise ConnectionError(f"connect failed less than {RETRY_S} s ago; not retried yet")
        address = (self.info.host, self.info.port)
        try:
            sock = socket.create_connection(address, timeout=CONNECT_TIMEOUT_S)
        except OSError:
            self._connect_failed_at = time.monotonic()
            raise
        sock.settimeout(IO_TIMEOUT_S)  # NOTE: a send that makes no progress fails the write
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        keep_alive(sock)
        return sock

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            segments, notif, fence, handle = job
            if not handle.start():
                continue
            try:
                if self.stopping:
                    raise ConnectionError("peer removed")
                self.sock = self.sock or self._connect()
                self._send(self.sock, segments, notif, fence)
            except OSError as exc:
                logger.warning("tcp write to %s failed: %s", self.info.name, exc)
                handle.failed = True
                if self.sock is not None:
                    self.sock.close()
                self.sock = None
            handle.done.set()
        if self.sock is not None:
            self.sock.close()

    def _send(
        self,
        sock: socket.socket,
        segments: Sequence[Segment],
        notif: bytes,
        fence: WriteFence | None,
    ) -> None:
        header = msgspec.msgpack.encode(
            TcpWrite(self.plane.name, [(r, n) for _, r, n in segments], notif, fence)
        )
        tag = self.plane.tag(header)
        sock.sendall(_LEN.pack(len(header)) + header + tag)
        pool = self.plane.pool_view()
        mac = self.plane.payload_mac(tag)
        if mac is None:
            for local, _, nbytes in segments:
                sock.sendall(pool[local : local + nbytes])
            return
        for local, _, nbytes in segments:
            for start in range(local, local + nbytes, PIECE_BYTES):
                piece = pool[start : min(start + PIECE_BYTES, local + nbytes)]
                mac.update(piece)
                sock.sendall(piece)
        sock.sendall(mac.digest())


class TcpDataPlane(DataPlane):
    """Data plane over plain TCP sockets bound to ``host``.

    Its descriptor names ``advertise_host`` (default: ``host``), where senders
    connect: a wildcard bind must be given a routable one
    (:func:`fabric.transfer.addresses.advertised_host`).
    """

    kind = "tcp"
    fences_writes = True

    def __init__(
        self,
        name: str,
        host: str = "127.0.0.1",
        secret: str | None = None,
        advertise_host: str | None = None,
    ) -> None:
        super().__init__(name)
        self._key = secret.encode() if secret else None
        self._host = advertise_host or advertised_host(host)
        self._listener = socket.create_server((bind_host(host), 0))
        self._port = self._listener.getsockname()[1]
        self._notifs: deque[tuple[str, bytes]] = deque()
        self._senders: dict[str, _PeerSender] = {}
        self._senders_lock = threading.Lock()
        self._conns: list[socket.socket] = []
        self._closed = False
        self.bad_frames = 0
        self._accepter = named_thread(self._accept, name="tcp-accept")
        self._accepter.start()

    def _register(self, base_address: int, nbytes: int, device: str) -> None:
        if device not in HOST_DEVICES:
            raise TransportFailed("the TCP data plane moves host memory only")

    def tag(self, header: bytes) -> bytes:
        """The header's HMAC tag (empty without a secret)."""
        return b"" if self._key is None else hmac.digest(self._key, header, "sha256")

    def payload_mac(self, header_tag: bytes) -> hmac.HMAC | None:
        """The running tag of a write's payload (None without a secret)."""
        return None if self._key is None else hmac.new(self._key, header_tag, "sha256")

    def pool_view(self) -> memoryview:
        raw = (ctypes.c_char * self.pool_nbytes).from_address(self.pool_base)
        return memoryview(raw).cast("B")

    def descriptor(self) -> bytes:
        info = TcpDescriptor(self.name, self._host, self._port, self.pool_nbytes)
        return msgspec.msgpack.encode(info)

    def add_peer(self, descriptor: bytes) -> str:
        try:
            info = msgspec.msgpack.decode(descriptor, type=TcpDescriptor)
        except msgspec.DecodeError as exc:
            raise TransportFailed(f"bad TCP peer descriptor: {exc}") from exc
        with self._senders_lock:
            if info.name not in self._senders:
                self._senders[info.name] = _PeerSender(self, info)
        return info.name

    def remove_peer(self, peer: str) -> None:
        with self._senders_lock:
            sender = self._senders.pop(peer, None)
        if sender is not None:
            sender.stop()

    def peer_count(self) -> int:
        return len(self._senders)

    def post_write(
        self,
        peer: str,
        segments: Sequence[Segment],
        notif: bytes,
        fence: WriteFence | None = None,
    ) -> WriteHandle:
        sender = self._senders.get(peer)
        if sender is None:
            raise TransportFailed(f"unknown TCP peer {peer!r}")
        self.check_segments(segments, sender.info.pool_nbytes)
        handle = _TcpWriteHandle()
        sender.jobs.put((list(segments), notif, fence, handle))
        return handle

    def take_notifs(self) -> list[tuple[str, bytes]]:
        return drain(self._notifs)

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            keep_alive(conn)
            self._conns.append(conn)
            named_thread(self._serve, args=(conn,), name="tcp-recv").start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            while True:
                self._receive_frame(conn)
        except (OSError, ConnectionError, TransportFailed, msgspec.DecodeError) as exc:
            if not self._closed and not isinstance(exc, ConnectionError):
                self.bad_frames += 1
                logger.warning("tcp data connection dropped: %s", exc)
        finally:
            conn.close()
            with contextlib.suppress(ValueError):
                self._conns.remove(conn)

    def _receive_frame(self, conn: socket.socket) -> None:
        head = bytearray(_LEN.size)
        _recv_exact(conn, memoryview(head))
        (length,) = _LEN.unpack(head)
        if length > _MAX_HEADER:
            raise TransportFailed(f"header of {length} bytes")
        header = bytearray(length + (_TAG_BYTES if self._key else 0))
        _recv_exact(conn, memoryview(header))
        tag = b""
        if self._key is not None:
            body, tag = bytes(header[:length]), bytes(header[length:])
            if not hmac.compare_digest(self.tag(body), tag):
                raise TransportFailed("data-plane frame with a bad signature")
            header = bytearray(body)
        msg = msgspec.msgpack.decode(header, type=TcpWrite)
        for remote, nbytes in msg.remote_segments:
            if nbytes <= 0 or remote < 0 or remote + nbytes > self.pool_nbytes:
                raise TransportFailed(f"segment {(remote, nbytes)} outside the pool")
        segments = msg.remote_segments
        ticket = self.admit(msg.sender, msg.fence, segments)
        conn.settimeout(IO_TIMEOUT_S)
        if ticket is None:
            # NOTE: the notification goes too: it would vouch for bytes that
            # never landed (and fail a live reservation a stray write named).
            trailer = _TAG_BYTES if self._key is not None else 0
            _drain(conn, sum(n for _, n in segments) + trailer)
            conn.settimeout(None)
            return
        self._receive_payload(conn, segments, ticket, self.payload_mac(tag))
        conn.settimeout(None)  # NOTE: between writes the connection may idle
        if msg.notif:
            self._notifs.append((msg.sender, msg.notif))

    def _receive_payload(
        self,
        conn: socket.socket,
        segments: list[tuple[int, int]],
        ticket: WriteTicket,
        mac: hmac.HMAC | None,
    ) -> None:
        """Copy an admitted write's bytes straight into the pool (each read
        within IO_TIMEOUT_S, so a sender gone mid-write lets the slot go);
        with a secret, check the payload's tag (TransportFailed if wrong)."""
        pool = self.pool_view()
        try:
            for remote, nbytes in segments:
                if mac is None:
                    _recv_exact(conn, pool[remote : remote + nbytes])
                    continue
                for start in range(remote, remote + nbytes, PIECE_BYTES):
                    piece = pool[start : min(start + PIECE_BYTES, remote + nbytes)]
                    _recv_exact(conn, piece)
                    mac.update(piece)
            if mac is not None:
                tag = bytearray(_TAG_BYTES)
                _recv_exact(conn, memoryview(tag))
                if not hmac.compare_digest(mac.digest(), bytes(tag)):
                    raise TransportFailed("data-plane payload with a bad signature")
        finally:
            ticket.end()

    def close(self) -> None:
        self._closed = True
        with self._senders_lock:
            senders = list(self._senders.values())
            self._senders.clear()
        for sender in senders:
            sender.stop()
        deadline = time.monotonic() + CLOSE_TIMEOUT_S
        for sender in senders:
            # NOTE: one deadline: a peer stuck mid-write delays close once, not once per peer
            sender.thread.join(timeout=max(0.0, deadline - time.monotonic()))
        self._listener.close()
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()
