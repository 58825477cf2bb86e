"""Sending end of the fabric: reserve remote slots, WRITE chunks, notify.

A :class:`TransferClient` owns one process's view of its peers; ``connect``
returns a :class:`PeerLink` per receiver endpoint (handshake done once).
Typical push of chunks already packed into the local store::

    link = client.connect("tcp://127.0.0.1:5600")
    res = link.reserve("req-1", keys, nbytes)          # Reserved or raises
    push = link.write(res, range(len(keys)), local_slots)
    push.wait(timeout=5.0)                             # bytes landed, notified

Every call is bounded: control requests by ``control_timeout_ms``
(:class:`~fabric.errors.PeerUnreachable`), writes by the caller's timeout
and, however they are driven, by ``write_timeout_ms``
(:class:`~fabric.errors.TransferTimeout`; the write is aborted).

Peers are independent. ``connect`` does a handshake without holding the
client's lock, so a receiver that accepts the connection and never answers
delays only the caller connecting to it. A control socket never blocks a
send: it queues only to a peer whose connection is up (``IMMEDIATE``), with
small high-water marks, and a send that cannot leave before the deadline
fails the call. A socket whose call timed out is closed (``LINGER`` 0) and
rebuilt, so a request still queued in it never reaches the peer later; the
receiver sees a new identity and the link says Hello again. The link itself
stays (and so does its data-plane peer, with the writes in flight to it).
Replies are paired with requests by ``seq``: one that answers an earlier
request (a late one, or the answer to a Cancel sent without waiting) is
dropped, save a HelloAck, whose data-plane agent the link takes.

``cancel_later`` never waits: it queues a Cancel on the link, sent (with a
Hello first on a rebuilt socket) as soon as the socket takes it without
blocking, by the next call or ``flush``, until its time is up; its answer is
not waited for. Per-request state is dropped when the request ends
(``PeerLink.forget``; ``cancel`` too); :meth:`TransferClient.table_sizes`
reports what is left. A link's data-plane peer is removed when the last
link to it closes (``TransferClient.disconnect``). A link posts no write
once the lease it knows of has run out (by its own clock,
from when it asked: never later than the receiver's) or was cancelled, and
raises :class:`~fabric.errors.ReservationExpired` instead; so every byte it
sends lands within ``write_timeout_ms`` of a live lease's end, inside the
receiver's quarantine if the reservation ended meanwhile.

With ``TransferConfig.secret`` requests and notifications are signed and
replies verified; a receiver with another secret (or none) fails the call
at once with a :class:`~fabric.errors.TransferError` that says so.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import zmq

from fabric.errors import (
    FabricError,
    LayoutMismatch,
    PeerDisconnected,
    PeerUnreachable,
    ProtocolError,
    ReplayError,
    ReservationExpired,
    ReservationRefused,
    SignatureError,
    TransferError,
    TransferTimeout,
    TransportFailed,
)
from fabric.transfer import protocol as proto
from fabric.transfer.addresses import is_loopback
from fabric.transfer.dataplane import Segment, WriteFence, WriteHandle, XferState
from fabric.transfer.faults import FaultInjector

if TYPE_CHECKING:
    from fabric.kv.direct import CacheMap
    from fabric.store import ChunkStore
    from fabric.transfer.config import TransferConfig
    from fabric.transfer.dataplane import DataPlane

logger = logging.getLogger(__name__)

# NOTE: below Linux's TCP keepalive as UCX sets it (10 s idle, then probes):
# a route unused this long is loaded again before the next write.
ROUTE_IDLE_RELOAD_S = 10.0


@dataclass(frozen=True)
class RemoteReservation:
    """Slots a receiver granted for one request's chunk keys."""

    request_id: str
    keys: tuple[bytes, ...]
    nbytes: tuple[int, ...]
    slots: tuple[int, ...]
    generations: tuple[int, ...]
    already_present: tuple[bool, ...]

    @property
    def missing(self) -> list[int]:
        """Indices of chunks the receiver does not have yet."""
        return [i for i, hit in enumerate(self.already_present) if not hit]


class PendingPush:
    """A posted write of some chunks of a reservation.

    It lives until ``expires_at`` (monotonic seconds) at most: polled past
    it, the write is aborted and TransferTimeout raised, so no write outlives
    the receiver's quarantine however its owner drives it. Dropped unfinished,
    it is abandoned (aborted) too.
    """

    def __init__(
        self,
        handle: WriteHandle | None,
        nbytes: int,
        on_finish: Callable[[], None] | None = None,
        *,
        expires_at: float = math.inf,
    ) -> None:
        self._handle = handle
        self.nbytes = nbytes
        self._on_finish = on_finish
        self.expires_at = expires_at
        self.route_epoch = 0  # the link's route epoch it was posted over (PeerLink)
        self.rewrote = False  # a part sent again from the chunk's first byte (PeerLink)

    @property
    def running(self) -> bool:
        """Whether the write may still move bytes (neither done, failed nor aborted)."""
        return self._handle is not None

    def done(self) -> bool:
        """True once every byte landed; TransportFailed on error, TransferTimeout
        (write aborted) once it outlived ``expires_at``."""
        if self._handle is None:
            return True
        state = self._handle.poll()
        if state is XferState.ERR:
            self._finish()
            raise TransportFailed("data-plane write failed")
        if state is XferState.DONE:
            self._finish()
            return True
        if time.monotonic() >= self.expires_at:
            self.abort()
            raise TransferTimeout(f"write of {self.nbytes} bytes outlived its lifetime; aborted")
        return False

    def wait(self, timeout: float) -> None:
        """Drive the write to completion within ``timeout`` seconds, else abort it."""
        deadline = time.monotonic() + timeout
        spins = 0
        while not self.done():
            if time.monotonic() >= deadline:
                self.abort()
                raise TransferTimeout(f"write of {self.nbytes} bytes not done in {timeout} s")
            spins += 1
            # NOTE: poll drives progress (no NIXL progress thread); yield the
            # core between polls so the peer and the engine keep running.
            time.sleep(0 if spins < 20 else 5e-5)

    def abort(self) -> bool:
        """Stop the write if it still runs (NIXL: release its handle, which
        cancels it). True when no byte of it can land any more; False when
        some still may, which the receiver's quarantine or guard covers."""
        handle, self._handle = self._handle, None
        if handle is None:
            return True
        ended = handle.abort()
        if not ended:
            # NOTE: the write may still read its source: a fault's scratch slot stays taken.
            self._on_finish = None
        self._finish()
        return ended

    def _finish(self) -> None:
        if self._handle is not None:
            self._handle.release()
            self._handle = None
        if self._on_finish is not None:
            self._on_finish()
            self._on_finish = None

    def __del__(self) -> None:
        # NOTE: a backstop for owners that drop a write they gave up on.
        handle = getattr(self, "_handle", None)
        if handle is not None:
            handle.abandon()


# NOTE: one request is in flight per link (calls hold its lock), so a few
# messages of queue is plenty; anything more would only be stale.
CONTROL_HWM = 16
MAX_LEASES = 256
MAX_CANCELS = 256


@dataclass(frozen=True)
class ChunkOffer:
    """One chunk (or its leading ``layers`` layers) of an :meth:`PeerLink.offer_many`."""

    index: int
    block_ids: Sequence[int]
    checksum: int
    layers: int = 0


class PeerLink:
    """Control channel and data-plane route to one receiver.

    Calls are serialized per link and each is bounded by
    ``control_timeout_ms``; ``close`` may come from any thread (a call in
    progress closes the socket when it ends). ``cancel_later`` and ``flush``
    never wait (see the module docstring).
    """

    def __init__(self, client: TransferClient, endpoint: str) -> None:
        self.client, self.endpoint = client, endpoint
        self._lock = threading.Lock()  # one call at a time; guards the socket
        self._state = threading.Lock()  # guards _closed and _busy
        self._closed = self._busy = False
        self._seq = itertools.count(1)
        self._sock = self._open_socket()
        # request_id -> when its lease runs out by our clock (see ``_post_check``).
        self._leases: dict[str, float] = {}
        # request_id -> until when a Cancel for it is still worth sending.
        self._cancels: dict[str, float] = {}
        self._leases_lock = threading.Lock()  # guards _leases and _cancels
        self._route_suspect = False  # reload the data-plane route before the next write
        self.route_epoch = 0  # bumped by every reload of the route (see ``write``'s ``landed``)
        self._route_used_at = time.monotonic()  # the last write posted, or the last (re)load
        self._writes: weakref.WeakSet[PendingPush] = weakref.WeakSet()  # posted over the route
        try:
            ack = self._handshake()
            self.peer_agent = client.plane.add_peer(ack.data_descriptor)
        except BaseException:
            self._sock.close(linger=0)
            raise
        self.remote_slot_bytes = ack.slot_bytes
        self.remote_num_slots = ack.num_slots
        self.peer_reads = ack.reads  # NOTE: it READs offered chunks (direct reads)

    def _open_socket(self) -> zmq.Socket[bytes]:
        # NOTE: a new socket is a new identity the receiver has not heard Hello from.
        self._hello_sent = False
        self._hellos: set[int] = set()  # seqs of the Hellos sent without waiting
        config = self.client.config
        sock = self.client.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, config.max_message_bytes + proto.SOCKET_SLACK_BYTES)
        # NOTE: queue only to a connection that is up, so a send to a dead or
        # silent peer is refused (and times out) instead of waiting in a pipe
        # to be delivered, stale, when the peer comes back.
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.SNDHWM, CONTROL_HWM)
        sock.setsockopt(zmq.RCVHWM, CONTROL_HWM)
        sock.setsockopt(zmq.CONNECT_TIMEOUT, config.control_timeout_ms)
        sock.setsockopt(zmq.HANDSHAKE_IVL, config.control_timeout_ms)
        sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
        sock.connect(self.endpoint)
        return sock

    @property
    def closed(self) -> bool:
        return self._closed

    def _hello(self) -> proto.Hello:
        plane = self.client.plane
        return proto.Hello(
            next(self._seq),
            plane.name,
            plane.kind,
            self.client.fingerprint,
            plane.descriptor(),
            self.client.store.pool.checksum_name,
        )

    def _handshake(self) -> proto.HelloAck:
        reply = self._call(self._hello())
        if isinstance(reply, proto.Refused):
            if reply.code == proto.Refusal.LAYOUT_MISMATCH:
                raise LayoutMismatch(f"{self.endpoint}: {reply.reason}")
            raise TransferError(f"{self.endpoint} refused the handshake: {reply.reason}")
        if not isinstance(reply, proto.HelloAck):
            raise ProtocolError(f"expected HelloAck, got {type(reply).__name__}")
        own = self.client.store.pool.checksum_name
        if reply.checksum != own:
            # NOTE: a receiver from before Hello.checksum accepts any sender
            # (it ignores the field) and says xxh3: refused on this side too
            raise LayoutMismatch(
                f"{self.endpoint}: chunk checksum: the receiver's pool hashes with "
                f"{reply.checksum}, this sender's ({self.client.store.pool.device}) with {own}; "
                + proto.CHECKSUM_HINT
            )
        return reply

    def _call_known(
        self,
        msg: proto.Message,
        tick: Callable[[], None] | None = None,
        *,
        same_agent: bool = False,
    ) -> proto.Message:
        """``_call`` for messages that need a Hello first: a receiver that
        forgot this link (idle past its ``peer_idle_s``, restarted on the
        same endpoint, or seeing a rebuilt socket) answers ``no_hello``; say
        Hello again and resend once. ``same_agent``: not to a new process
        (its reservations are not ours): ``ReservationRefused`` instead."""
        return self._call_known_many([msg], tick, same_agent=same_agent)[0]

    def _call_known_many(
        self,
        msgs: Sequence[proto.Message],
        tick: Callable[[], None] | None = None,
        *,
        same_agent: bool = False,
    ) -> list[proto.Message]:
        """:meth:`_call_known` for several messages sent back to back (their
        replies in their order); those answered ``no_hello`` go again, once,
        after a new Hello."""
        replies = self._call_many(msgs, tick)
        again = [
            i
            for i, reply in enumerate(replies)
            if isinstance(reply, proto.Refused) and reply.code == proto.Refusal.NO_HELLO
        ]
        refused = sum(isinstance(reply, proto.Refused) for reply in replies)
        if again and refused == len(again):  # NOTE: not when another was refused anyway
            before = self.peer_agent
            self._adopt(self._handshake())
            if same_agent and self.peer_agent != before:
                raise ReservationRefused(
                    f"{self.endpoint} is another process now (agent {self.peer_agent!r}); "
                    f"{type(msgs[again[0]]).__name__} not sent to it"
                )
            for i, reply in zip(
                again, self._call_many([msgs[i] for i in again], tick), strict=True
            ):
                replies[i] = reply
        return replies

    def _adopt(self, ack: proto.HelloAck) -> None:
        """Use the data-plane agent a (new) HelloAck names.

        NOTE: a receiver restarted on the same endpoint has a new agent; one
        that only forgot us has the same one, already loaded here.
        """
        with contextlib.suppress(TransportFailed):
            agent = self.client.plane.add_peer(ack.data_descriptor)
            self.peer_reads = ack.reads
            old, self.peer_agent = self.peer_agent, agent
            if old != agent:
                # NOTE: the leases were the old process's: no write from them
                self._forget_leases()
                self.client.release_agent(old, self)

    def _call(self, msg: proto.Message, tick: Callable[[], None] | None = None) -> proto.Message:
        """Send ``msg`` and wait for the reply with its ``seq``; PeerUnreachable
        (socket rebuilt) when none comes within ``control_timeout_ms``.
        ``tick``: called about every ms while waiting (to drive the data plane)."""
        return self._call_many([msg], tick)[0]

    def _call_many(
        self, msgs: Sequence[proto.Message], tick: Callable[[], None] | None = None
    ) -> list[proto.Message]:
        """:meth:`_call` for several messages sent back to back, each answered
        on its own (the receiver works on them meanwhile); their replies in
        their order, once all came, all within one ``control_timeout_ms``."""
        timeout_ms = self.client.config.control_timeout_ms
        frames = [self.client.codec.encode(msg) for msg in msgs]
        with self._lock, self._using():
            if any(isinstance(msg, proto.Hello) for msg in msgs):
                self._hello_sent = True
            try:
                replies = self._exchange(msgs, frames, time.monotonic() + timeout_ms / 1000, tick)
            except PeerUnreachable:
                self._sock.close(linger=0)
                self._sock = self._open_socket()
                self._route_suspect = True  # NOTE: whatever cut this may have cut the data plane
                raise
            self._send_cancels()  # NOTE: after the call: its socket is up now
            return replies

    @contextlib.contextmanager
    def _using(self) -> Iterator[None]:
        """Use the socket (the lock is held): PeerUnreachable once the link
        is closed; closed by another thread meanwhile, the socket is closed
        here when done."""
        with self._state:
            if self._closed:
                raise PeerUnreachable(f"{self.endpoint}: link closed")
            self._busy = True
        try:
            yield
        finally:
            with self._state:
                self._busy, closed = False, self._closed
            if closed:
                self._sock.close(linger=0)

    def _exchange(
        self,
        msgs: Sequence[proto.Message],
        frames: Sequence[bytes],
        deadline: float,
        tick: Callable[[], None] | None = None,
    ) -> list[proto.Message]:
        """Send ``msgs`` and wait for the reply to each (by seq), in their
        order. With several, an error (a frame that could not go, an answer
        that did not decode, a refusal of the link) is raised only once the
        messages that went were all answered or the deadline passed: each
        may be work the receiver does on this side's memory (an Offer's
        READ), which the caller must not give up while it may still run."""
        seqs = [msg.seq for msg in msgs]  # type: ignore[union-attr]
        name, timeout_ms = type(msgs[0]).__name__, self.client.config.control_timeout_ms
        error: FabricError | None = None
        sent = 0
        for frame in frames:
            left_ms = max(1, int((deadline - time.monotonic()) * 1000))
            try:
                if not self._sock.poll(left_ms, zmq.POLLOUT):
                    raise PeerUnreachable(
                        f"{self.endpoint}: not connected in {timeout_ms} ms ({name})"
                    )
                self._sock.send(frame, zmq.NOBLOCK)
            except zmq.Again:
                error = PeerUnreachable(f"{self.endpoint}: cannot send {name}")
            except PeerUnreachable as exc:
                error = exc
            if error is not None:
                if not sent:
                    raise error
                break
            sent += 1
        waiting = set(seqs[:sent])
        replies: dict[int, proto.Message] = {}
        while waiting and (left := deadline - time.monotonic()) > 0:
            if tick is not None:
                tick()
                if not self._sock.poll(1):
                    continue
            elif not self._sock.poll(max(1, int(left * 1000))):
                break
            try:
                reply = decode_reply(self.client.codec, self._sock.recv(), self.endpoint)
                seq = getattr(reply, "seq", None)
                if seq in waiting:
                    replies[seq] = reply
                    waiting.discard(seq)
                    continue
                if isinstance(reply, proto.Refused) and reply.seq == -1:
                    raise_refused(reply, self.endpoint)
            except FabricError as exc:
                if len(seqs) == 1:
                    raise
                error = error or exc  # NOTE: an undecodable answer's message is unknown
                continue
            self._stale(reply)
        if error is not None:
            raise error
        if not waiting:
            return [replies[s] for s in seqs]
        some = f" ({len(waiting)} of {len(seqs)})" if len(seqs) > 1 else ""
        raise PeerUnreachable(f"{self.endpoint}: no answer to {name}{some} in {timeout_ms} ms")

    def _stale(self, reply: proto.Message) -> None:
        """A reply to an earlier request (one that timed out, or a Hello or
        Cancel sent without waiting): dropped, save the agent of a HelloAck
        to a Hello of this socket (the lock is held)."""
        seq = getattr(reply, "seq", None)
        if seq in self._hellos:
            self._hellos.discard(seq)
            if isinstance(reply, proto.HelloAck):
                self._adopt(reply)

    # ------------------------------------------------------------ Cancels sent without waiting
    def cancel_later(self, request_id: str, within_s: float) -> None:
        """Give the reservation of ``request_id`` back without waiting: no
        write for it is posted from here on, and a Cancel goes as soon as the
        socket takes it (now, or on a later call or ``flush``), if within
        ``within_s``. Best effort: its answer is not waited for."""
        self._forget_lease(request_id)
        with self._leases_lock:
            self._cancels.pop(request_id, None)
            self._cancels[request_id] = time.monotonic() + within_s
            while len(self._cancels) > MAX_CANCELS:  # NOTE: the oldest goes first
                del self._cancels[next(iter(self._cancels))]
        self.flush()

    def flush(self) -> bool:
        """Send the queued Cancels the socket takes now, and drop the replies
        waiting in it; never waits (skipped while a call runs, which sends
        them itself). True when none is left to send."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            with self._using():
                with contextlib.suppress(zmq.ZMQError, FabricError):
                    while self._sock.poll(0):
                        frame = self._sock.recv(zmq.NOBLOCK)
                        self._stale(decode_reply(self.client.codec, frame, self.endpoint))
                self._send_cancels()
        except PeerUnreachable:
            return True  # NOTE: closed: its Cancels went with it
        finally:
            self._lock.release()
        return not self.num_cancels

    def _send_cancels(self) -> None:
        """Send queued Cancels while the socket takes them without blocking;
        a Hello first on a socket that has said none (the lock is held)."""
        with self._leases_lock:
            now = time.monotonic()
            self._cancels = {r: t for r, t in self._cancels.items() if t > now}
            pending = list(self._cancels)
        try:
            if not pending or not self._sock.poll(0, zmq.POLLOUT):
                return
            if not self._hello_sent:
                hello = self._hello()
                self._sock.send(self.client.codec.encode(hello), zmq.NOBLOCK)
                self._hello_sent = True
                self._hellos.add(hello.seq)
            for request_id in pending:
                cancel = proto.Cancel(next(self._seq), request_id)
                self._sock.send(self.client.codec.encode(cancel), zmq.NOBLOCK)
                with self._leases_lock:
                    self._cancels.pop(request_id, None)
        except zmq.ZMQError:
            return  # NOTE: the rest goes with a later call or flush

    @property
    def num_cancels(self) -> int:
        with self._leases_lock:
            return len(self._cancels)

    def reserve(
        self,
        request_id: str,
        keys: Sequence[bytes],
        nbytes: Sequence[int],
        lease_ms: int | None = None,
    ) -> RemoteReservation:
        """Reserve one remote slot per key; raises ReservationRefused."""
        lease = lease_ms or self.client.config.lease_ms
        asked = time.monotonic()
        reply = self._call_known(
            proto.Reserve(next(self._seq), request_id, list(keys), list(nbytes), lease)
        )
        if isinstance(reply, proto.Refused):
            raise ReservationRefused(f"{reply.code}: {reply.reason}")
        if not isinstance(reply, proto.Reserved) or len(reply.slots) != len(keys):
            raise ProtocolError(f"bad reply to Reserve: {type(reply).__name__}")
        self._track_lease(request_id, asked + reply.lease_ms / 1000)
        return RemoteReservation(
            request_id,
            tuple(keys),
            tuple(nbytes),
            tuple(reply.slots),
            tuple(reply.generations),
            tuple(reply.already_present),
        )

    def write(
        self,
        res: RemoteReservation,
        indices: Iterable[int],
        local_slots: Sequence[int],
        *,
        landed: Mapping[int, int] | None = None,
        landed_epoch: int = -1,
    ) -> PendingPush:
        """WRITE chunks ``indices`` of ``res`` from ``local_slots`` (same order).

        Chunks the receiver already has are skipped; the notification names
        the chunks written with their checksums and slot generations.
        ``landed``: leading bytes of a chunk that :meth:`write_part` wrote
        from the same local slot, and that completed over route epoch
        ``landed_epoch``: only the rest is sent -- unless the route was
        loaded again since (NIXL may have reported done a write whose bytes
        never landed on the old route), or is while this write is posted:
        then the whole chunk goes. The WriteDone says where each chunk's
        bytes in this write begin (``starts``).
        """
        indices = list(indices)
        if landed_epoch != self.route_epoch or self.client.faults is not None:
            landed = None  # NOTE: the faults' write path posts its segments as planned
        segments, written, checksums = self._plan(res, indices, local_slots, landed or {})
        if not segments:
            return PendingPush(None, 0)
        fence = _fence(res, written)
        faults = self.client.faults
        if faults is not None:
            return self._write_with_faults(faults, res, segments, written, checksums, fence)
        self._post_check(res.request_id)
        epoch = self.route_epoch

        def post() -> WriteHandle:
            sent = segments
            if landed and self.route_epoch != epoch:  # NOTE: reloaded just now
                sent = self._plan(res, indices, local_slots, {})[0]
            starts = [
                far - res.slots[i] * self.remote_slot_bytes
                for (_, far, _), i in zip(sent, written, strict=True)
            ]
            notif = self._notif(res, written, checksums, starts)
            return self.client.plane.post_write(self.peer_agent, sent, notif, fence)

        pending = self._pending(self._posted(res.request_id, post), segments)
        pending.route_epoch = self.route_epoch
        return pending

    def write_part(
        self,
        res: RemoteReservation,
        index: int,
        local_slot: int,
        span: tuple[int, int],
        layers: int,
    ) -> PendingPush:
        """WRITE bytes ``span`` (start, stop) of chunk ``index`` of ``res`` from
        ``local_slot`` (packed there, not yet committed: no checksum yet),
        notified as ``WritePart(layers)``: the chunk's leading ``layers``
        layers are in once it completes. A receiver admits one write into a
        slot at a time: post the next part, or the chunk's :meth:`write`,
        once this one completed. A route loaded again while it is posted
        has the part sent from the chunk's first byte; the result's
        ``route_epoch`` says over which route it went."""
        start, stop = span
        nbytes = res.nbytes[index]
        if res.already_present[index] or not 0 <= start < stop <= nbytes:
            raise TransferError(
                f"chunk {index}: no part {start}..{stop} of {nbytes} bytes to write"
            )
        pool = self.client.store.pool
        if stop > pool.slot_bytes:
            raise TransferError(f"local slot {local_slot} has no byte {stop - 1}")
        remote = res.slots[index] * self.remote_slot_bytes
        segments = [(pool.slot_offset(local_slot) + start, remote + start, stop - start)]
        notif = self.client.codec.encode(
            proto.WritePart(res.request_id, index, res.generations[index], layers)
        )
        self._post_check(res.request_id)
        fence = _fence(res, [index])
        epoch = self.route_epoch

        rewrote: list[bool] = []

        def post() -> WriteHandle:
            sent = segments
            if start and self.route_epoch != epoch:  # NOTE: reloaded just now: from byte 0
                local, far, _ = segments[0]
                sent = [(local - start, far - start, stop)]
                rewrote.append(True)
            return self.client.plane.post_write(self.peer_agent, sent, notif, fence)

        pending = self._pending(self._posted(res.request_id, post), segments)
        pending.route_epoch = self.route_epoch
        pending.rewrote = bool(rewrote)
        return pending

    def _posted(self, request_id: str, post: Callable[[], WriteHandle]) -> WriteHandle:
        """``post()`` over a route to the receiver that can be trusted.

        The receiver's data-plane agent is loaded again first when the route
        may have died since it was last used: a control call to the receiver
        failed meanwhile, or nothing was written to it for
        ``ROUTE_IDLE_RELOAD_S`` -- and no write of this link still runs. (An
        outage that long can have let TCP keepalive end UCX's connection, or
        left it in retransmission backoff, and NIXL then reports writes done
        whose bytes never land, or refuses them for good.) A post refused
        because the route is gone (PeerDisconnected: nothing was sent) reloads
        it and is retried once. A reload takes a Hello (up to
        ``control_timeout_ms``): the lease of ``request_id`` is checked again
        after it, so no write is posted past its lease.
        """
        idle = time.monotonic() - self._route_used_at > ROUTE_IDLE_RELOAD_S
        if (self._route_suspect or idle) and self._route_quiet():
            self._reload_agent("after a failed call" if self._route_suspect else "idle")
            self._post_check(request_id)
        try:
            handle = post()
        except PeerDisconnected as exc:
            if not self._route_quiet():
                raise
            self._reload_agent(str(exc))
            self._post_check(request_id)
            handle = post()
        self._route_used_at = time.monotonic()
        return handle

    def _route_quiet(self) -> bool:
        """No write of this link runs, none the data plane gave up on may still
        land (its orphans), and no other link shares the receiver's agent:
        the route may be dropped."""
        if any(w.running for w in list(self._writes)):
            return False
        if getattr(self.client.plane, "orphans", None):
            return False
        return not self.client.agent_shared(self.peer_agent, self)

    def _reload_agent(self, why: str) -> None:
        """Load the receiver's data-plane agent anew (a Hello for its
        descriptor): NIXL opens a new connection to it.

        A receiver that restarted on the endpoint meanwhile names another
        agent: the slots this link reserved were the old process's, so its
        leases end (ReservationExpired) and nothing is written to the new
        process's pool from them.
        """
        logger.info("fabric: %s: loading its data-plane route again (%s)", self.endpoint, why)
        self._route_suspect = True  # NOTE: until the reload is through
        old = self.peer_agent
        self.client.plane.remove_peer(old)
        ack = self._handshake()
        try:
            self.peer_agent = self.client.plane.add_peer(ack.data_descriptor)
        except TransportFailed as exc:
            raise PeerDisconnected(
                f"{self.endpoint}: its data plane cannot be loaded: {exc}"
            ) from exc
        self._route_suspect, self._route_used_at = False, time.monotonic()
        self.route_epoch += 1
        if self.peer_agent != old:
            self._forget_leases()
            raise ReservationExpired(
                f"{self.endpoint} restarted (its data-plane agent is new): "
                "the slots reserved from the old one are gone; write not posted"
            )

    def _forget_leases(self) -> None:
        """End every lease of this link (the receiver that granted them is gone)."""
        with self._leases_lock:
            self._leases.clear()

    def _pending(
        self,
        handle: WriteHandle,
        segments: list[Segment],
        on_finish: Callable[[], None] | None = None,
    ) -> PendingPush:
        lifetime = self.client.config.write_timeout_ms / 1000
        nbytes = sum(n for _, _, n in segments)
        pending = PendingPush(handle, nbytes, on_finish, expires_at=time.monotonic() + lifetime)
        self._writes.add(pending)
        return pending

    def _track_lease(self, request_id: str, expires_at: float, *, extend: bool = False) -> None:
        with self._leases_lock:
            if extend:
                expires_at = max(expires_at, self._leases.get(request_id, expires_at))
            self._leases[request_id] = expires_at
            if len(self._leases) > MAX_LEASES:  # NOTE: a backstop for owners that never forget
                now = time.monotonic()
                self._leases = {r: t for r, t in self._leases.items() if t > now}

    def _post_check(self, request_id: str) -> None:
        """Raise ReservationExpired unless the lease of ``request_id`` still runs.

        NOTE: our deadline counts from before the Reserve (or Heartbeat) left,
        so it is never later than the receiver's: a write posted before it
        lands inside the lease or inside the quarantine that follows it.
        """
        with self._leases_lock:
            expires_at = self._leases.get(request_id, -math.inf)
        if time.monotonic() >= expires_at:
            raise ReservationExpired(
                f"{self.endpoint}: the lease of {request_id!r} ran out (or was cancelled); "
                "write not posted"
            )

    def _plan(
        self,
        res: RemoteReservation,
        indices: Iterable[int],
        local_slots: Sequence[int],
        landed: Mapping[int, int],
    ) -> tuple[list[Segment], list[int], list[int]]:
        """One segment per chunk the receiver lacks (less its ``landed``
        leading bytes), with its index and checksum."""
        store = self.client.store
        pool = store.pool
        segments: list[Segment] = []
        written: list[int] = []
        checksums: list[int] = []
        for index, slot in zip(indices, local_slots, strict=True):
            if res.already_present[index]:
                continue
            nbytes = res.nbytes[index]
            checksum = store.slot_checksum(slot)
            if checksum is None or store.slot_nbytes(slot) != nbytes:
                raise TransferError(f"local slot {slot} does not hold chunk {index}")
            remote = res.slots[index] * self.remote_slot_bytes
            skip = min(landed.get(index, 0), nbytes - 1)  # NOTE: a write carries >= 1 byte
            segments.append((pool.slot_offset(slot) + skip, remote + skip, nbytes - skip))
            written.append(index)
            checksums.append(checksum)
        return segments, written, checksums

    def _notif(
        self,
        res: RemoteReservation,
        written: list[int],
        checksums: list[int],
        starts: list[int] | None = None,
    ) -> bytes:
        """The WriteDone of chunks ``written``; ``starts``: where each one's
        bytes in this write begin (None: whole chunks)."""
        generations = [res.generations[i] for i in written]
        return self.client.codec.encode(
            proto.WriteDone(res.request_id, written, generations, checksums, starts or [])
        )

    def _write_with_faults(
        self,
        faults: FaultInjector,
        res: RemoteReservation,
        segments: list[Segment],
        written: list[int],
        checksums: list[int],
        fence: WriteFence,
    ) -> PendingPush:
        """``write`` with the sender faults of :mod:`fabric.transfer.faults` applied."""
        store, plane = self.client.store, self.client.plane
        faults.delay()
        segments, scratch = faults.corrupt(store, segments, checksums)
        notif = self._notif(res, written, checksums)
        try:
            self._post_check(res.request_id)  # NOTE: after the delay, as a stalled sender
            mode = faults.write_mode()
            if mode == "drop_write":
                handle = self._posted(res.request_id, lambda: plane.notify(self.peer_agent, notif))
            else:
                notif = b"" if mode == "drop_notify" else notif
                handle = self._posted(
                    res.request_id,
                    lambda: plane.post_write(self.peer_agent, segments, notif, fence),
                )
        except BaseException:
            faults.release(store, scratch)
            raise
        return self._pending(handle, segments, lambda: faults.release(store, scratch))

    def push(
        self,
        request_id: str,
        keys: Sequence[bytes],
        local_slots: Sequence[int],
        *,
        timeout: float,
        lease_ms: int | None = None,
    ) -> RemoteReservation:
        """Reserve, write every chunk and wait for the write; cancel on failure."""
        store = self.client.store
        nbytes = [store.slot_nbytes(s) for s in local_slots]
        res = self.reserve(request_id, keys, nbytes, lease_ms)
        try:
            self.write(res, range(len(keys)), local_slots).wait(timeout)
        except TransferError:
            self.cancel(request_id)
            raise
        return res

    def offer(
        self,
        res: RemoteReservation,
        index: int,
        block_ids: Sequence[int],
        checksum: int,
        cache: CacheMap,
        layers: int = 0,
    ) -> None:
        """Offer chunk ``index`` for the receiver to READ from this process's
        cache (direct reads): ``block_ids`` hold it, final, and ``checksum``
        is its checksum; with ``layers`` short of the layout's, only its
        leading ``layers`` layers are final (a part: ``checksum`` unused)
        and the receiver reads those it has not read. Returns once the
        receiver read it (the blocks may be reused from then on, not after
        a part: the rest is read from them later); raises
        ``ReservationRefused`` when it will not or could not (a failed or
        timed-out read, a lease gone), ``PeerUnreachable`` when no answer
        came within the control timeout (a read may still be running then:
        the receiver verifies what it read, so the blocks may be reused, but
        not trusted to have moved)."""
        self.offer_many(res, [ChunkOffer(index, block_ids, checksum, layers)], cache)

    def offer_many(
        self, res: RemoteReservation, offers: Sequence[ChunkOffer], cache: CacheMap
    ) -> None:
        """:meth:`offer` of several chunks (or parts) of ``res``, each chunk
        once, sent back to back: the receiver reads each as it comes while
        the next are on their way, and answers each once its read ended.
        Returns once every answer came (all within one control timeout);
        then raises as :meth:`offer` would for the first that failed."""
        self._post_check(res.request_id)
        if not self.client.may_offer(self.endpoint):
            # NOTE: unsigned, whoever answers on that address would be handed the
            # cache (its Hello and Reserve are not checked): refused, as binding is
            raise ReservationRefused(
                f"{self.endpoint} is beyond loopback and no secret is set: no Offer "
                "names this side's cache to it (set a secret, or insecure: true)"
            )
        if not offers:
            return
        if len({o.index for o in offers}) != len(offers):
            raise ValueError("offer_many: a chunk offered twice at once")
        regions = self.client.plane.region_descriptor(self.peer_agent)
        msgs = [
            proto.Offer(
                next(self._seq),
                res.request_id,
                o.index,
                res.generations[o.index],
                o.checksum,
                list(o.block_ids),
                cache,
                o.layers,
                regions,
            )
            for o in offers
        ]
        # NOTE: the receiver's READ may need this side's agent to answer
        # (connection wire-up; UCX transports that emulate RMA): it is
        # driven while the answers are awaited
        # NOTE: never to a process that did not grant the reservation: the
        # Offer names this side's cache
        replies = self._call_known_many(msgs, self.client.plane.progress, same_agent=True)
        for o, reply in zip(offers, replies, strict=True):
            if isinstance(reply, proto.Refused):
                raise ReservationRefused(f"{reply.code}: {reply.reason}")
            if not isinstance(reply, proto.Ack) or reply.request_id != res.request_id:
                raise ProtocolError(f"bad reply to Offer: {type(reply).__name__}")
            if not reply.ok:
                raise ReservationRefused(f"chunk {o.index} of {res.request_id} was not read")

    def ping(self) -> bool:
        """Whether the receiver answers a control call on this link at all (a
        Stats, which the receiver answers before any Hello). Raises
        ``PeerUnreachable`` when no answer came within the control timeout
        (or the link is closed)."""
        reply = self._call(proto.Stats(next(self._seq)))
        return isinstance(reply, proto.StatsReply | proto.Refused)

    def cancel(self, request_id: str) -> bool:
        """Give the reservation back; no write for it is posted from here on."""
        self._forget_lease(request_id)
        reply = self._call_known(proto.Cancel(next(self._seq), request_id))
        return isinstance(reply, proto.Ack) and reply.ok

    def heartbeat(self, request_id: str, lease_ms: int | None = None) -> bool:
        """Extend the lease; False (and no more writes posted) if it is gone."""
        lease = lease_ms or self.client.config.lease_ms
        asked = time.monotonic()
        reply = self._call_known(proto.Heartbeat(next(self._seq), request_id, lease))
        ok = isinstance(reply, proto.Ack) and reply.ok
        if ok:
            self._track_lease(request_id, asked + lease / 1000, extend=True)
        else:
            self._forget_lease(request_id)
        return ok

    def forget(self, request_id: str) -> None:
        """The request is over (done, failed or given up): drop its lease
        here, so no write for it is posted any more. Sends nothing."""
        self._forget_lease(request_id)

    def _forget_lease(self, request_id: str) -> None:
        with self._leases_lock:
            self._leases.pop(request_id, None)

    @property
    def num_leases(self) -> int:
        with self._leases_lock:
            return len(self._leases)

    def close(self) -> None:
        """Close the socket and, unless another link uses it, the data-plane
        peer. From any thread: a call in progress ends first (bounded), then
        its thread closes the socket."""
        with self._state:
            if self._closed:
                return
            self._closed, busy = True, self._busy
        with self._leases_lock:
            self._cancels.clear()
        self.client.release_agent(self.peer_agent, self)
        if not busy:
            self._sock.close(linger=0)


class TransferClient:
    """One process's sending side: its store, data plane and peer links."""

    def __init__(
        self, store: ChunkStore, plane: DataPlane, config: TransferConfig, fingerprint: str
    ) -> None:
        self.store, self.plane, self.config = store, plane, config
        self.fingerprint = fingerprint
        self.codec = config.codec()
        self.faults = FaultInjector(config.faults, "send") if config.faults.enabled else None
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._links: dict[str, PeerLink] = {}
        self._lock = threading.Lock()

    def may_offer(self, endpoint: str) -> bool:
        """Whether an ``Offer`` (naming this process's KV cache) may go to
        ``endpoint``: signed (a secret), ``insecure`` set, or on loopback."""
        config = self.config
        host = endpoint.removeprefix("tcp://").rpartition(":")[0]
        return config.secret is not None or config.insecure or is_loopback(host)

    def connect(self, endpoint: str) -> PeerLink:
        """The link to ``endpoint``, doing the handshake on first use.

        NOTE: the handshake runs outside the client's lock: a silent
        endpoint delays only the threads connecting to it. Two threads may
        both say Hello to a new endpoint; the second link is closed.
        """
        with self._lock:
            link = self._links.get(endpoint)
        if link is not None:
            return link
        fresh = PeerLink(self, endpoint)
        with self._lock:
            link = self._links.setdefault(endpoint, fresh)
        if link is not fresh:
            fresh.close()
        return link

    def current_link(self, endpoint: str) -> PeerLink | None:
        """The link ``connect`` would return now (None: it would say Hello)."""
        with self._lock:
            return self._links.get(endpoint)

    def disconnect(self, endpoint: str, link: PeerLink | None = None) -> None:
        """Drop the link to ``endpoint`` (if any; only if it is ``link`` when
        given, never a newer one); the next ``connect`` says Hello."""
        with self._lock:
            current = self._links.get(endpoint)
            if current is None or (link is not None and current is not link):
                return
            del self._links[endpoint]
        current.close()

    def agent_shared(self, agent: str, link: PeerLink) -> bool:
        """Whether a link other than ``link`` uses data-plane peer ``agent``."""
        with self._lock:
            return any(o is not link and o.peer_agent == agent for o in self._links.values())

    def release_agent(self, agent: str, link: PeerLink) -> None:
        """``link`` no longer uses data-plane peer ``agent``: remove it unless
        another of our links still does."""
        if not self.agent_shared(agent, link):
            self.plane.remove_peer(agent)

    def table_sizes(self) -> dict[str, int]:
        """Entries of the per-peer and per-request tables: links, the leases
        they track, the Cancels they have still to send, and the data plane's
        peers."""
        with self._lock:
            links = list(self._links.values())
        return {
            "links": len(links),
            "leases": sum(link.num_leases for link in links),
            "cancels": sum(link.num_cancels for link in links),
            "data_peers": self.plane.peer_count(),
        }

    def close(self) -> None:
        with self._lock:
            links, self._links = list(self._links.values()), {}
        for link in links:
            link.close()


def _fence(res: RemoteReservation, written: list[int]) -> WriteFence:
    """The fence of a write of chunks ``written`` (one segment each, in order)."""
    slots = [res.slots[i] for i in written]
    return WriteFence(res.request_id, slots, [res.generations[i] for i in written])


def decode_reply(codec: proto.Codec, frame: bytes, endpoint: str) -> proto.Message:
    """A control reply; a signature problem becomes a TransferError naming the cause."""
    try:
        return codec.decode(frame)
    except ReplayError as exc:
        raise TransferError(
            f"{endpoint}: reply rejected ({exc}); check that both hosts' clocks are in sync"
        ) from exc
    except SignatureError as exc:
        mine = "a secret" if codec.signed else "no secret"
        raise TransferError(
            f"{endpoint}: reply rejected ({exc}); this side has {mine}: "
            "both ends need the same transfer secret"
        ) from exc


def raise_refused(reply: proto.Refused, endpoint: str) -> None:
    """Raise the error for a ``Refused`` the receiver could not tie to a request."""
    if reply.code == proto.Refusal.BAD_SIGNATURE:
        cause = (
            "check that both hosts' clocks are in sync"
            if "not in sync" in reply.reason
            else "both ends need the same transfer secret (and release)"
        )
        raise TransferError(f"{endpoint} refused our signature ({reply.reason}): {cause}")
    raise ProtocolError(f"{endpoint} refused our message: {reply.code}: {reply.reason}")
