"""Receiving end of the fabric: reservations in, verified chunks out.

    sender (PeerLink)                     receiver (TransferServer)
    -----------------                     -------------------------
    Hello ------------------ ZMQ -------> fingerprint/transport check
          <------------------------------ HelloAck (data-plane descriptor)
    Reserve(keys, nbytes, lease) -------> store.reserve -> Reserved(slots)
                                          (or Refused: pool full, ...)
    data-plane WRITE into the slots ====> bytes land in the pool
    notification WriteDone(indices, ----> verifier thread: checksum, then
      checksums, generations)             store.fill -> key present

One loop thread owns the ZMQ ROUTER socket and polls the data plane for
notifications: every ``poll_interval_ms`` while writes are outstanding,
every ``idle_poll_interval_ms`` otherwise, never busy-spinning. It also
expires leases. A verifier thread hashes landed chunks, so the loop keeps
serving while large chunks are checked. Bad frames are answered with
``Refused``, counted in ``stats``, and never stop the server.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import zmq

from fabric.errors import (
    CapacityError,
    ChecksumMismatch,
    FabricError,
    ProtocolError,
    ReservationExpired,
    SlotStateError,
)
from fabric.transfer import protocol as proto

if TYPE_CHECKING:
    from fabric.store import ChunkStore
    from fabric.store.tier import TieredStore
    from fabric.transfer.config import TransferConfig
    from fabric.transfer.dataplane import DataPlane

logger = logging.getLogger(__name__)


@dataclass
class ServerStats:
    """Counters of a TransferServer (monotonic)."""

    hellos: int = 0
    reservations: int = 0
    refused: int = 0
    protocol_errors: int = 0
    chunks_filled: int = 0
    bytes_filled: int = 0
    checksum_failures: int = 0
    late_writes: int = 0
    cancels: int = 0
    expired: int = 0
    lookups: int = 0


@dataclass
class RequestProgress:
    """What has landed for one reservation."""

    request_id: str
    expected: frozenset[int]
    landed: set[int] = field(default_factory=set)  # notified, not yet verified
    filled: set[int] = field(default_factory=set)  # verified and indexed
    failed: set[int] = field(default_factory=set)
    expired: bool = False

    @property
    def complete(self) -> bool:
        return self.expected <= self.filled

    @property
    def finished(self) -> bool:
        """Nothing more will change: complete, or a chunk failed, or expired."""
        return self.complete or bool(self.failed) or self.expired


class TransferServer:
    """Serves reservations on a ZMQ ROUTER and verifies chunks as they land."""

    def __init__(
        self,
        store: ChunkStore,
        plane: DataPlane,
        config: TransferConfig,
        fingerprint: str,
        *,
        tier: TieredStore | None = None,
    ) -> None:
        self.store, self.plane, self.config, self.tier = store, plane, config, tier
        self.fingerprint = fingerprint
        self.stats = ServerStats()
        self._sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, config.max_message_bytes + 1024)
        if config.port:
            self._sock.bind(f"tcp://{config.host}:{config.port}")
            port = config.port
        else:
            port = self._sock.bind_to_random_port(f"tcp://{config.host}")
        self.endpoint = f"tcp://{config.host}:{port}"
        self._peers: dict[bytes, str] = {}
        self._progress: dict[str, RequestProgress] = {}
        self._cond = threading.Condition()
        self._verify_q: queue.Queue[proto.WriteDone | None] = queue.Queue()
        self._stop = threading.Event()
        self._loop = threading.Thread(target=self._run, name="fabric-server", daemon=True)
        self._verifier = threading.Thread(target=self._verify, name="fabric-verify", daemon=True)

    def start(self) -> TransferServer:
        self._loop.start()
        self._verifier.start()
        return self

    # ------------------------------------------------------------ consumers
    def progress(self, request_id: str) -> RequestProgress | None:
        with self._cond:
            return self._progress.get(request_id)

    def wait(self, request_id: str, timeout: float) -> RequestProgress | None:
        """Block until the reservation is finished or ``timeout`` s passed."""
        return self.wait_until(request_id, lambda p: p.finished, timeout)

    def wait_until(
        self,
        request_id: str,
        predicate: Callable[[RequestProgress], bool],
        timeout: float,
    ) -> RequestProgress | None:
        """Block until ``predicate(progress)`` holds, the reservation is
        finished, or ``timeout`` s passed; returns the progress (or None if
        the reservation is unknown). Woken on every landing, fill or failure.
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                prog = self._progress.get(request_id)
                left = deadline - time.monotonic()
                if prog is not None and (prog.finished or predicate(prog)):
                    return prog
                if left <= 0:
                    return prog
                self._cond.wait(left)

    def release(self, request_id: str) -> None:
        """The consumer is done with a reservation's chunks."""
        with self._cond:
            self._progress.pop(request_id, None)
        self.store.release(request_id)

    def close(self) -> None:
        self._stop.set()
        self._verify_q.put(None)
        if self._loop.is_alive():
            self._loop.join(timeout=5)
        if self._verifier.is_alive():
            self._verifier.join(timeout=5)
        self._sock.close(linger=0)

    # ------------------------------------------------------------ loop
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        next_expire = 0.0
        while not self._stop.is_set():
            if self._wait_control(poller, busy=self._has_outstanding()):
                self._drain_control()
            for peer, msg in self.plane.take_notifs():
                self._on_notif(peer, msg)
            if (now := time.monotonic()) >= next_expire:
                self._expire()
                next_expire = now + self.config.expire_interval_ms / 1000

    def _wait_control(self, poller: zmq.Poller, *, busy: bool) -> bool:
        """Wait for a control message at most one polling period.

        NOTE: zmq's poll truncates its timeout to whole milliseconds, so the
        sub-millisecond period used while writes are outstanding is a sleep.
        """
        if not busy:
            return bool(poller.poll(max(1, round(self.config.idle_poll_interval_ms))))
        if poller.poll(0):
            return True
        time.sleep(self.config.poll_interval_ms / 1000)
        return bool(poller.poll(0))

    def _has_outstanding(self) -> bool:
        with self._cond:
            return any(not p.finished for p in self._progress.values())

    def _drain_control(self) -> None:
        while True:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            if len(frames) != 2:
                self.stats.protocol_errors += 1
                continue
            identity, frame = frames
            reply = self._handle(identity, frame)
            self._sock.send_multipart([identity, proto.encode(reply)])

    def _handle(self, identity: bytes, frame: bytes) -> proto.Message:
        try:
            msg = proto.decode(frame, self.config.max_message_bytes)
        except ProtocolError as exc:
            self.stats.protocol_errors += 1
            logger.warning("refused control frame: %s", exc)
            return proto.Refused(-1, "", "bad_message", str(exc))
        if isinstance(msg, proto.Hello):
            return self._on_hello(identity, msg)
        if isinstance(msg, proto.Lookup | proto.Release | proto.Clear | proto.Pin):
            return self._on_tier(msg)
        if identity not in self._peers:
            self.stats.refused += 1
            return proto.Refused(getattr(msg, "seq", -1), "", "no_hello", "send Hello first")
        if isinstance(msg, proto.Reserve):
            return self._on_reserve(msg)
        if isinstance(msg, proto.Cancel):
            self.stats.cancels += 1
            self._forget(msg.request_id, expired=True)
            return proto.Ack(msg.seq, msg.request_id, self.store.cancel(msg.request_id))
        if isinstance(msg, proto.Heartbeat):
            ok = self.store.heartbeat(msg.request_id, msg.lease_ms)
            return proto.Ack(msg.seq, msg.request_id, ok)
        self.stats.protocol_errors += 1
        return proto.Refused(getattr(msg, "seq", -1), "", "bad_message", "unexpected message")

    def _on_hello(self, identity: bytes, msg: proto.Hello) -> proto.Message:
        if msg.fingerprint != self.fingerprint:
            self.stats.refused += 1
            reason = f"KV layout fingerprint {msg.fingerprint} != receiver's {self.fingerprint}"
            return proto.Refused(msg.seq, "", "layout_mismatch", reason)
        if msg.transport != self.plane.kind:
            self.stats.refused += 1
            reason = f"sender uses {msg.transport}, receiver {self.plane.kind}"
            return proto.Refused(msg.seq, "", "transport_mismatch", reason)
        try:
            self.plane.add_peer(msg.data_descriptor)
        except Exception as exc:
            self.stats.refused += 1
            return proto.Refused(msg.seq, "", "bad_descriptor", str(exc))
        self._peers[identity] = msg.agent_name
        self.stats.hellos += 1
        pool = self.store.pool
        return proto.HelloAck(
            msg.seq,
            self.plane.name,
            self.plane.kind,
            self.fingerprint,
            self.plane.descriptor(),
            pool.slot_bytes,
            pool.num_slots,
        )

    def _on_reserve(self, msg: proto.Reserve) -> proto.Message:
        if len(msg.keys) != len(msg.nbytes) or not msg.keys:
            self.stats.refused += 1
            return proto.Refused(msg.seq, msg.request_id, "bad_request", "keys/nbytes mismatch")
        try:
            res = self.store.reserve(msg.request_id, msg.keys, msg.nbytes, msg.lease_ms)
        except CapacityError as exc:
            self.stats.refused += 1
            return proto.Refused(msg.seq, msg.request_id, "capacity", str(exc))
        except SlotStateError as exc:
            self.stats.refused += 1
            return proto.Refused(msg.seq, msg.request_id, "duplicate", str(exc))
        except ValueError as exc:
            self.stats.refused += 1
            return proto.Refused(msg.seq, msg.request_id, "bad_request", str(exc))
        self.stats.reservations += 1
        expected = frozenset(i for i, hit in enumerate(res.already_present) if not hit)
        with self._cond:
            self._progress[msg.request_id] = RequestProgress(msg.request_id, expected)
            self._cond.notify_all()
        return proto.Reserved(
            msg.seq,
            msg.request_id,
            list(res.slots),
            list(res.generations),
            list(res.already_present),
            msg.lease_ms,
        )

    def _on_tier(
        self, msg: proto.Lookup | proto.Release | proto.Clear | proto.Pin
    ) -> proto.Message:
        """Lookups and admin for the reuse tier: asked by this engine's
        scheduler and by the proxy, so no Hello is needed."""
        tier = self.tier
        if tier is None:
            self.stats.refused += 1
            return proto.Refused(msg.seq, "", "no_tier", "this engine keeps no reuse tier")
        try:
            if isinstance(msg, proto.Lookup):
                self.stats.lookups += 1
                hit = tier.lookup(
                    msg.token_ids,
                    hold=msg.request_id if msg.hold else None,
                    lease_ms=msg.lease_ms,
                )
                return proto.LookupResult(
                    msg.seq,
                    msg.request_id,
                    tier.chunk_tokens,
                    hit.chunks,
                    hit.disk,
                    bool(hit.slots),
                )
            if isinstance(msg, proto.Release):
                return proto.Done(msg.seq, int(tier.release_hold(msg.request_id)))
            if isinstance(msg, proto.Clear):
                return proto.Done(msg.seq, tier.clear(msg.tier))
            return proto.Done(msg.seq, tier.pin(msg.token_ids, pin=msg.pin))
        except (ValueError, FabricError) as exc:
            self.stats.refused += 1
            return proto.Refused(msg.seq, "", "bad_request", str(exc))

    def _on_notif(self, peer: str, frame: bytes) -> None:
        try:
            msg = proto.decode(frame, self.config.max_message_bytes)
        except ProtocolError as exc:
            self.stats.protocol_errors += 1
            logger.warning("refused notification from %s: %s", peer, exc)
            return
        if not isinstance(msg, proto.WriteDone):
            self.stats.protocol_errors += 1
            return
        with self._cond:
            prog = self._progress.get(msg.request_id)
            if prog is not None:
                prog.landed.update(msg.indices)
                self._cond.notify_all()
        self._verify_q.put(msg)

    def _expire(self) -> None:
        self.stats.expired += self.store.expire()
        if self.tier is not None:
            self.tier.expire_holds()
        with self._cond:
            gone = [
                rid
                for rid, prog in self._progress.items()
                if not prog.finished and self.store.reservation(rid) is None
            ]
            for rid in gone:
                self._progress[rid].expired = True
            if gone:
                self._cond.notify_all()

    def _forget(self, request_id: str, *, expired: bool) -> None:
        with self._cond:
            prog = self._progress.pop(request_id, None)
            if prog is not None and expired:
                prog.expired = True
            self._cond.notify_all()

    # ------------------------------------------------------------ verifier
    def _verify(self) -> None:
        while (msg := self._verify_q.get()) is not None:
            for index, checksum, generation in zip(
                msg.indices, msg.checksums, msg.generations, strict=False
            ):
                self._fill_one(msg.request_id, index, checksum, generation)

    def _fill_one(self, request_id: str, index: int, checksum: int, generation: int) -> None:
        ok = False
        try:
            self.store.fill(request_id, index, checksum, generation)
            ok = True
        except ChecksumMismatch as exc:
            self.stats.checksum_failures += 1
            logger.warning("request %s chunk %d: %s", request_id, index, exc)
        except (ReservationExpired, SlotStateError) as exc:
            self.stats.late_writes += 1
            logger.warning("ignored write for %s chunk %d: %s", request_id, index, exc)
            return
        res = self.store.reservation(request_id)
        with self._cond:
            prog = self._progress.get(request_id)
            if prog is None:
                return
            if ok:
                prog.filled.add(index)
                self.stats.chunks_filled += 1
                if res is not None:
                    self.stats.bytes_filled += self.store.slot_nbytes(res.slots[index])
            else:
                prog.failed.add(index)
            self._cond.notify_all()
