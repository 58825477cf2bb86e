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
notifications: every ``poll_interval_ms`` while writes are outstanding and
a notification or control message came in the last ``QUIET_AFTER_MS``,
every ``quiet_poll_interval_ms`` while they are outstanding but nothing
came for that long (a decoder admitted at dispatch holds its reservation
through the whole prefill before the first chunk), every
``idle_poll_interval_ms`` otherwise (a control message wakes it at once),
and every ``EMPTY_POLL_MS`` while it holds nothing that runs out by the
clock (a prefiller's receiver, an idle decoder's), never busy-spinning. It
also expires leases. A verifier thread hashes
landed chunks, so the loop keeps serving while large chunks are checked.

The loop never runs long blocking work. A request whose answer reads or
deletes disk files or waits for the disk writer (a Lookup that holds, a
Pin, a Clear, when the tier has a disk; an application handler's own through
:meth:`TransferServer.defer`) runs on an :class:`~fabric.transfer.offload.Offload`
thread; the loop sends its reply when it is done. Two queues, so the
scheduler's Lookups (and a shared store's Fetches) never wait behind an
operator's Clear or Pin::

    Lookup(hold), Fetch   -> offload: 2 threads, 64 queued
    Clear, Pin            -> admin:   1 thread,  16 queued

A request whose queue is full is answered at once with
``Refused(code="busy")`` (``offload.BUSY``; ``reason`` names the queue):
transient, nothing was done, ask again later. While the server closes,
queued and new blocking requests get ``Refused(code="closing")``
(``offload.CLOSING``). Notifications, heartbeats, Reserves and lease
expiry go on meanwhile.

Closing (``close``) waits for the blocking work running now, at most
``close_timeout_s`` for both queues together, before the loop stops and
the owner frees what that work uses (the tier, its disk tier, the pool).
Past that bound it logs a warning and stops anyway: the reply of a job
still running is never sent (its client times out), its thread (a daemon)
and the offload's wake pipe are left as they are, and the job meets a
closed tier (a hold it makes is dropped at once, a disk tier raises
``StoreError``, answered to nobody); the pool's memory stays allocated
while the job holds a reference to it.

Per-request tables stay bounded: a reservation's progress goes when its
consumer releases it or its sender cancels it, and otherwise once the store
no longer holds its reservation (expired by its lease, e.g. a transfer
nobody loads): it is then marked expired, kept ``ENDED_LINGER_S`` for a
consumer still polling it, and dropped. A transfer its consumer released
before any Reserve for it came (its load stopped waiting, or its request
ended) is kept ``ABANDONED_LINGER_S`` in the ``abandoned`` table: a Reserve
for it is refused ``released`` and counted in ``reserves_late``; it takes no
slot. A transfer whose Reserve was refused here (capacity, duplicate, bad
request) is kept ``REFUSED_LINGER_S`` in the ``refusals`` table: no sender
retries a refused push, so a load waiting for it stops at once
(:meth:`TransferServer.refusal`) instead of after its grace. Peers are
bounded by ``peer_idle_s``; warnings by their kinds.
:meth:`TransferServer.table_sizes` reports them (with the store's, the
tier's and the owner's ``extra_tables``), also in ``Stats`` as
``tables.<name>``.

Bad frames are answered with ``Refused``, counted in ``stats``, and never
stop the server: an undecodable, oversized or wrongly typed frame is
``bad_message``, a missing or wrong HMAC tag ``bad_signature`` (checked
before the payload is decoded), a Reserve from a peer that has not said
Hello ``no_hello``. Frames over ``max_message_bytes`` plus a little slack
never reach Python: ZMQ drops them with their connection (counted in
``disconnects``). A notification that fails its checks is dropped and
counted. Replies are signed like requests.

Writes are fenced too (:mod:`fabric.transfer.fence`): where the plane sees
them arrive (TCP, loopback), each is admitted against the live reservation
before a byte lands, else drained (notification and all) and counted in
``refused_writes``.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import zmq

from fabric.errors import (
    CapacityError,
    ChecksumMismatch,
    FabricError,
    LayoutError,
    ProtocolError,
    ReservationExpired,
    SignatureError,
    SlotStateError,
)
from fabric.kv.direct import Spans, direct_plan, map_spans
from fabric.threads import thread as named_thread
from fabric.transfer import protocol as proto
from fabric.transfer.addresses import bind_host, warn_if_insecure
from fabric.transfer.dataplane import XferState
from fabric.transfer.faults import FaultInjector
from fabric.transfer.fence import StoreWriteGuard, check_quarantine
from fabric.transfer.offload import BUSY, CLOSING, Offload
from fabric.transfer.progress import PrefillNote, RequestProgress
from fabric.transfer.server_stats import ServerStats
from fabric.transfer.tier_requests import (
    TierRequest,
    blocks,
    is_admin,
    leave_process,
    serve_in_process,
    tier_reply,
)

if TYPE_CHECKING:
    from fabric.kv import KVLayout
    from fabric.store import ChunkStore
    from fabric.store.tier import TieredStore
    from fabric.transfer.config import TransferConfig
    from fabric.transfer.dataplane import DataPlane, WriteHandle

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

Handler = Callable[[bytes, proto.Message], "proto.Message | None"]
"""An application's answer to one message type: ``(identity, msg) -> reply``
(None: handed to :meth:`TransferServer.defer`, which replies later)."""

MAX_REASON_CHARS = 512
WARN_EVERY_S = 10.0
ENDED_LINGER_S = 1.0  # an ended reservation's progress, kept for a consumer still polling
TABLES_PREFIX = "tables."  # Stats keys of table sizes: tables.<name> -> entries
CLOSE_TIMEOUT_S = 10.0  # how long close waits for blocking work running now
MAX_PREFILL_NOTES = 65536  # transfers whose prefill state is kept at once
PREFILL_NOTE_LINGER_S = 60.0  # a note is dropped this long after it ran out (or was final)
RELEASED_LINGER_S = 2.0  # a released transfer's note: late words for it are ignored this long
ABANDONED_LINGER_S = 40.0
"""How long a transfer released before any Reserve came for it (its load
stopped waiting, or its request ended) is remembered: a Reserve for it is
refused (``released``) this long. In the sequential flow a prefiller with a
backlog of pushes can be seconds later than ``unknown_transfer_grace_s``; such
a push would otherwise hold slots that nobody loads for its whole lease, and
under load fill the store for the pushes after it. One later than this is
reserved and holds its slots until its lease runs out."""
MAX_ABANDONED = 65536  # transfers remembered so at once; the oldest is forgotten first
REFUSED_LINGER_S = 40.0  # a transfer whose Reserve was refused: its load is told this long
QUIET_AFTER_MS = 20.0
"""Writes outstanding, nothing came for this long: poll at ``quiet_poll_interval_ms``.

Chunks of one push land back to back (a few ms apart), so a push in flight
is polled at ``poll_interval_ms``; a reservation that waits for a prefill to
compute its next chunk costs a wake-up per ``quiet_poll_interval_ms``, not
per ``poll_interval_ms``, and the notification of its next chunk is seen at
most that late (a control message wakes the loop at once). NOTE: where
UCX moves the bytes themselves by the target's progress (UCX over TCP, no
CMA or RDMA), a write that starts in a quiet spell is progressed at that
rate too: set ``quiet_poll_interval_ms`` to ``poll_interval_ms`` there."""
EMPTY_POLL_MS = 500.0
"""The loop's tick while the server holds nothing that runs out by the clock:
no transfer, READ, prefill note (kept a minute after its last word) or
tier hold, a store without leases or quarantined slots
(``ChunkStore.has_deadlines``), no data-plane handle left to release. What
it then has to do comes as a control message, which wakes it at once (a
Reserve, which makes a lease, before any write for it), or a hold made in
this process (``answer_here`` wakes it); its tick only prunes idle peers
and old notes. A notification with no transfer to land in is dropped
whenever it is taken. A prefiller drives UCX for a decoder's READ of its
cache while it waits for the Offer's answer (``PeerLink.offer``), not
through this loop. On a prefiller (which only sends) every tick while it
computes is one of these: each one costs 0.1-0.3 ms of the engine's core, cold caches and
all, 20 a second at the engine's ``idle_poll_interval_ms``, 2 at this."""
LAST_REPLY_S = 0.05
"""``close`` waits this long after the last reply went before it closes the
socket (without lingering, which would drop a reply ZMQ had not sent yet)."""
MAX_RUNNING_S = 60.0  # the longest one ``running`` holds, whatever its ttl
PRUNE_PREFILLS_S = 1.0  # how often the notes are pruned


@dataclasses.dataclass(eq=False)
class _Read:
    """A chunk this receiver READs from its sender's cache (an ``Offer``):
    answered to ``identity`` once ``handle`` ended; ``slot`` is held as
    being written (``store.begin_write``) until then."""

    identity: bytes
    offer: proto.Offer
    slot: int
    nbytes: int  # read now: the chunk's bytes from ``start`` to layer ``upto``
    handle: WriteHandle
    started: float
    upto: int  # layers read once this read ended
    final: bool  # the chunk's rest: verified once read
    start: int  # the chunk's first byte this read carries
    prog: RequestProgress  # the transfer's progress when offered (a part counts only there)


class TransferServer:
    """Serves reservations on a ZMQ ROUTER and verifies chunks as they land.

    ``offload``: runs the blocking requests (default: two threads, 64
    queued); ``admin``: the operator's Clear and Pin (default: one thread,
    16 queued). ``close_timeout_s``: how long ``close`` waits for the work
    they run.
    """

    def __init__(
        self,
        store: ChunkStore,
        plane: DataPlane,
        config: TransferConfig,
        fingerprint: str,
        *,
        tier: TieredStore | None = None,
        offload: Offload | None = None,
        admin: Offload | None = None,
        close_timeout_s: float = CLOSE_TIMEOUT_S,
        handlers: Mapping[type[proto.Message], Handler] | None = None,
        gate: Callable[[proto.Message], proto.Refused | None] | None = None,
        release_finished: bool = False,
    ) -> None:
        """``handlers``, ``gate`` and ``release_finished`` let an application
        serve its own messages beside the transfer protocol (the shared store:
        :mod:`fabric.shared_store.service`): ``handlers`` answer the message
        types they name (their reply, or None once they handed the work to
        :meth:`defer`; looked up by exact type: the protocol's message
        structs have no subclasses); ``gate`` may refuse any other message before the
        server's own handling (counted in ``refused``); with
        ``release_finished`` a push nobody reads is let go once it is
        finished (verified, failed or expired), its verified chunks staying
        in the store."""
        self.store, self.plane, self.config, self.tier = store, plane, config, tier
        self._handlers: Mapping[type[proto.Message], Handler] = dict(handlers or {})
        self._gate = gate
        self._release_finished = release_finished
        # NOTE: the owner's own numbers for Stats (the connector reports its
        # threads' health here, which the proxy's health probe reads).
        self.extra_stats: list[Callable[[], dict[str, int]]] = []
        # NOTE: and the sizes of its per-request tables (``table_sizes``).
        self.extra_tables: list[Callable[[], Mapping[str, int]]] = []
        self.fingerprint = fingerprint
        self.stats = ServerStats()
        self.codec = config.codec()
        self.faults = FaultInjector(config.faults, "receive") if config.faults.enabled else None
        self._sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, config.max_message_bytes + proto.SOCKET_SLACK_BYTES)
        self._monitor: zmq.Socket[bytes] = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        bind = bind_host(config.host)
        if config.port:
            self._sock.bind(f"tcp://{bind}:{config.port}")
            port = config.port
        else:
            port = self._sock.bind_to_random_port(f"tcp://{bind}")
        # NOTE: what peers connect to (not a wildcard bind: see fabric.transfer.addresses).
        self.endpoint = f"tcp://{config.advertised()}:{port}"
        warn_if_insecure(config.host, config.secret, f"the fabric server at {self.endpoint}")
        self._peers: dict[bytes, str] = {}  # control identity -> data-plane agent
        self._peer_seen: dict[bytes, float] = {}
        self._regions_of: dict[bytes, bytes] = {}  # identity -> region descriptor loaded
        self._next_prune = 0.0
        self._progress: dict[str, RequestProgress] = {}
        self._ended: dict[str, float] = {}  # request -> when its reservation was found gone
        self._prefills: dict[str, PrefillNote] = {}  # transfer -> the proxy's last word
        self._next_prefill_prune = 0.0
        self._came_at = 0.0  # when the loop last got a notification or control message
        self._sleeping_empty = False  # the loop waits EMPTY_POLL_MS now (holds nothing)
        self._drained_at = 0.0  # when the loop last began taking control frames
        self._replied_at = 0.0  # when the loop last sent a reply
        # transfer -> when it was released before a Reserve came (oldest first)
        self._abandoned: dict[str, float] = {}
        # transfer -> (when, why) its Reserve was refused (oldest first)
        self._refusals: dict[str, tuple[float, str]] = {}
        self._events = 0  # bumped on every change a consumer may wait for
        self._dirty: set[str] | None = set()  # transfers changed since take_dirty (None: all)
        self._offload = offload if offload is not None else Offload()
        self._admin = (
            admin if admin is not None else Offload(threads=1, max_queued=16, name="fabric-admin")
        )
        self.close_timeout_s = close_timeout_s
        self._cond = threading.Condition()
        self._verify_q: queue.Queue[proto.WriteDone | None] = queue.Queue()
        self._read_layout: KVLayout | None = None  # set: Offers are read (enable_reads)
        self._reads: list[_Read] = []  # the loop's: READs of offered chunks in flight
        self._reads_ending: set[str] = set()  # transfers whose READs the loop aborts next
        self._stop = threading.Event()
        self._warned: dict[str, float] = {}
        self._loop = named_thread(self._run, name="fabric-server")
        self._verifier = named_thread(self._verify, name="fabric-verify")
        plane.set_write_guard(StoreWriteGuard(lambda: self.store, self.stats))
        check_quarantine(store, plane, config.write_timeout_ms)

    def start(self) -> TransferServer:
        self._offload.start()
        self._admin.start()
        self._loop.start()
        self._verifier.start()
        serve_in_process(self)
        return self

    def enable_reads(self, layout: KVLayout) -> None:
        """Serve ``Offer``s: READ offered chunks from the sender's cache (of
        ``layout``, this engine's own) into their slots. Without it an
        Offer is refused."""
        if not self.plane.reads:
            raise FabricError(f"{self.plane.kind}: this data plane cannot read")
        self._read_layout = layout

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

    def wait_change(self, seen: int, timeout: float) -> int:
        """Block until something changed since event count ``seen`` (a chunk
        landed, verified or failed, a Reserve, an expiry, a prefill note,
        :meth:`wake`) or ``timeout`` s passed; returns the count now."""
        with self._cond:
            if self._events == seen:
                self._cond.wait(timeout)
            return self._events

    def events(self) -> int:
        """The event count now (for :meth:`wait_change`)."""
        with self._cond:
            return self._events

    def wake(self) -> None:
        """Wake whoever waits in :meth:`wait_change` (e.g. new work for it)."""
        with self._cond:
            self._notify(None)

    def take_dirty(self) -> set[str] | None:
        """The transfers that changed since the last call (None: any may have)."""
        with self._cond:
            dirty, self._dirty = self._dirty, set()
            return dirty

    def stream(self, request_id: str, index: int) -> bool:
        """Let the consumer verify chunk ``index`` of ``request_id`` itself, as
        it unpacks the chunk's layers while their parts land: the verifier
        will not hash it, and its WriteDone's checksum is left in the
        progress's ``sealed`` for :meth:`fill_streamed`. False (nothing
        changes) when the chunk is verified, failed or being verified now."""
        with self._cond:
            prog = self._progress.get(request_id)
            if prog is None or index not in prog.expected:
                return False
            if index in prog.filled or index in prog.failed or index in prog.verifying:
                return False
            prog.streamed.add(index)
            return True

    def fill_streamed(
        self,
        request_id: str,
        index: int,
        sealed: tuple[int, int, int],
        hashed: tuple[int, int] | None,
    ) -> bool:
        """Index streamed chunk ``index`` (``sealed``: its WriteDone's checksum,
        generation and first byte written) whose bytes the consumer hashed as it used them
        (``hashed``: the slot and its digest; None: hash the slot here);
        whether it verified. A mismatch fails the chunk as the verifier
        would; a digest of a slot the reservation no longer holds for it
        counts as a late write."""
        checksum, generation, _ = sealed
        slot, actual = hashed if hashed is not None else (None, None)
        self._fill_one(request_id, index, checksum, generation, actual=actual, slot=slot)
        with self._cond:
            prog = self._progress.get(request_id)
            return prog is not None and index in prog.filled

    def prefill_note(self, request_id: str) -> PrefillNote | None:
        """What the proxy last said of the prefill of transfer ``request_id``."""
        with self._cond:
            return self._prefills.get(request_id)

    def refusal(self, request_id: str) -> str | None:
        """Why a Reserve for transfer ``request_id`` was refused here (within
        ``REFUSED_LINGER_S``, and none granted since); None if none was."""
        with self._cond:
            refused = self._refusals.get(request_id)
        return None if refused is None else refused[1]

    def release(self, request_id: str) -> None:
        """The consumer is done with a reservation's chunks, or with a
        transfer that never came: words that come later are ignored for
        ``RELEASED_LINGER_S``, and a Reserve for a transfer that never came
        is refused for ``ABANDONED_LINGER_S``."""
        now = time.monotonic()
        self._end_reads(request_id)
        with self._cond:
            if self._progress.pop(request_id, None) is None:
                _remember(self._abandoned, request_id, now)
            self._refusals.pop(request_id, None)
            self._ended.pop(request_id, None)
            if request_id in self._prefills or len(self._prefills) < MAX_PREFILL_NOTES:
                self._prefills[request_id] = PrefillNote("released", now, now)
        self.store.release(request_id)

    def table_sizes(self) -> dict[str, int]:
        """Entries in the per-request tables of this server, its store, its
        tier and its owner's ``extra_tables`` (name -> entries; names are
        prefixed by component)."""
        with self._cond:
            sizes = {"server_progress": len(self._progress), "server_ended": len(self._ended)}
            sizes["server_prefills"] = len(self._prefills)
            sizes["server_abandoned"] = len(self._abandoned)
            sizes["server_refusals"] = len(self._refusals)
        sizes["server_peers"] = len(self._peer_seen)
        sizes["server_reads"] = len(self._reads)
        sizes["server_offload"] = self._offload.pending()
        sizes["server_admin"] = self._admin.pending()
        sizes |= self.store.table_sizes()
        if self.tier is not None:
            sizes |= self.tier.table_sizes()
        for extra in self.extra_tables:
            sizes |= extra()
        return sizes

    def defer(
        self,
        identity: bytes,
        seq: int,
        work: Callable[[], proto.Message],
        *,
        admin: bool = False,
    ) -> proto.Message | None:
        """Answer request ``seq`` of ``identity`` with ``work()``, run off the
        loop (it may block on disk or on other threads), on the admin queue
        with ``admin``: None when queued (the loop sends the reply when it is
        done), ``Refused(BUSY)`` when that queue is full, ``Refused(CLOSING)``
        once the server closes."""
        offload = self._admin if admin else self._offload
        if offload.submit(identity, seq, work):
            return None
        self.stats.refused += 1
        if offload.closed:
            return proto.Refused(seq, "", CLOSING, "the server is closing")
        queued = offload.pending()
        self._warn("busy", "refused a request: %d queued on %s", queued, offload.name)
        reason = f"the server's queue of blocking work ({offload.name}) is full: ask again later"
        return proto.Refused(seq, "", BUSY, reason)

    def close(self) -> None:
        """Stop serving. Blocking work first (see the module docstring): new
        and queued requests are answered ``closing``, and the jobs running
        now are waited for (``close_timeout_s`` in all) while the loop still
        sends their replies; then the loop, the verifier, the socket."""
        leave_process(self)
        deadline = time.monotonic() + self.close_timeout_s
        offloads = (self._offload, self._admin)
        for offload in offloads:
            offload.shutdown()
        idle = [offload.wait_idle(max(0.0, deadline - time.monotonic())) for offload in offloads]
        if not all(idle):
            running = sum(offload.running() for offload in offloads)
            logger.warning(
                "fabric server: %d blocking job(s) still running after %.0f s; closing anyway "
                "(their replies are dropped)",
                running,
                self.close_timeout_s,
            )
        self._stop.set()
        self._admin.wake()  # NOTE: a loop holding nothing sleeps up to EMPTY_POLL_MS
        self._verify_q.put(None)
        if self._loop.is_alive():
            self._loop.join(timeout=5)
        if self._verifier.is_alive():
            self._verifier.join(timeout=5)
        for offload, done in zip(offloads, idle, strict=True):
            offload.close(timeout=1.0 if done else 0.0)
        # NOTE: the socket is closed without lingering: give the last replies
        # (a job's that ended just now) a moment to leave first
        time.sleep(max(0.0, self._replied_at + LAST_REPLY_S - time.monotonic()))
        if not self._sock.closed:
            self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=0)

    # ------------------------------------------------------------ loop
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        poller.register(self._offload.wake_fd, zmq.POLLIN)
        poller.register(self._admin.wake_fd, zmq.POLLIN)
        next_expire = 0.0
        while not self._stop.is_set():
            try:
                next_expire = self._step(poller, next_expire)
            except Exception:
                # NOTE: a bug must not take the receiver down with it.
                self.stats.internal_errors += 1
                logger.exception("fabric server loop error")
                time.sleep(self.config.idle_poll_interval_ms / 1000)
        try:
            self._send_offloaded()  # NOTE: the last replies (``closing``) before close
        except Exception:
            logger.exception("fabric server: sending the last offloaded replies failed")

    def _step(self, poller: zmq.Poller, next_expire: float) -> float:
        ready = self._wait(poller, busy=self._has_outstanding())
        if self._sock in ready:
            self._drain_control()
        if self._monitor in ready:
            self._drain_monitor()
        if self._offload.wake_fd in ready or self._admin.wake_fd in ready:
            self._send_offloaded()
        notifs = self.plane.take_notifs()
        for peer, msg in notifs:
            self._on_notif(peer, msg)
        if self._reads or self._reads_ending:
            self._progress_reads()
        now = time.monotonic()
        if notifs or self._sock in ready:
            self._came_at = now
        if now >= next_expire:
            self._expire()
            next_expire = now + self.config.expire_interval_ms / 1000
        if self._release_finished:
            self._release_finished_pushes()
        return next_expire

    def _release_finished_pushes(self) -> None:
        with self._cond:
            done = [rid for rid, prog in self._progress.items() if prog.finished]
        for rid in done:
            self.release(rid)

    def _wait(self, poller: zmq.Poller, *, busy: bool) -> dict[zmq.Socket[bytes] | int, int]:
        """Wait for a control message (or offloaded work done) at most one polling period.

        NOTE: zmq's poll truncates its timeout to whole milliseconds, so a
        sub-millisecond period (``poll_interval_ms`` while writes are
        outstanding and something came lately) is a sleep, which a control
        message does not cut short; a period of 1 ms or more blocks in the
        poller, which it does.
        """
        self.stats.loop_wakeups += 1
        if not busy:
            period_ms = self.config.idle_poll_interval_ms
            self._sleeping_empty = self._holds_nothing()
            if self._sleeping_empty:
                period_ms = max(period_ms, EMPTY_POLL_MS)
            try:
                return dict(poller.poll(max(1, round(period_ms))))
            finally:
                self._sleeping_empty = False
        if ready := poller.poll(0):
            return dict(ready)
        quiet = time.monotonic() - self._came_at > QUIET_AFTER_MS / 1000
        c = self.config
        period_ms = c.quiet_poll_interval_ms if quiet else c.poll_interval_ms
        if period_ms >= 1:
            return dict(poller.poll(round(period_ms)))
        time.sleep(period_ms / 1000)
        return dict(poller.poll(0))

    def _send_offloaded(self) -> None:
        for identity, reply in self._offload.take_done() + self._admin.take_done():
            if isinstance(reply, proto.Refused):
                if reply.code == proto.Refusal.INTERNAL_ERROR:
                    self.stats.internal_errors += 1
                else:
                    self.stats.refused += 1
            self._reply(identity, reply)

    def _drain_monitor(self) -> None:
        while True:
            try:
                self._monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.stats.disconnects += 1

    def _holds_nothing(self) -> bool:
        """Whether nothing here runs out by the clock (see ``EMPTY_POLL_MS``).
        Not while the data plane keeps handles it could not release yet
        (NIXL's orphans: released on the loop's next notification poll)."""
        if self._reads or self._reads_ending or self.plane.holds_handles():
            return False
        with self._cond:
            if self._progress or self._prefills:
                return False
        if self.tier is not None and self.tier.held_count():
            return False
        return not self.store.has_deadlines()

    def _has_outstanding(self) -> bool:
        if self._reads:
            return True
        with self._cond:
            return any(not p.finished for p in self._progress.values())

    def _drain_control(self) -> None:
        # NOTE: no later than any frame of this pass came: an offered read's
        # bound counts from here, so it ends before its sender's wait does
        # (Offers sent back to back are taken in one pass, one after another)
        self._drained_at = time.monotonic()
        while True:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            identity = frames[0]
            if len(frames) != 2:
                self.stats.protocol_errors += 1
                reason = f"{len(frames) - 1} message parts, expected 1"
                reply: proto.Message | None = proto.Refused(
                    -1, "", proto.Refusal.BAD_MESSAGE, reason
                )
            else:
                reply = self._handle(identity, frames[1])
            if reply is not None:  # NOTE: None: deferred, the loop replies when done
                self._reply(identity, reply)

    def _reply(self, identity: bytes, reply: proto.Message) -> None:
        try:
            frame = self.codec.encode(reply)
        except ProtocolError as exc:
            self.stats.internal_errors += 1
            frame = self.codec.encode(proto.Refused(-1, "", proto.Refusal.INTERNAL_ERROR, str(exc)))
        try:
            self._sock.send_multipart([identity, frame], zmq.NOBLOCK)
            self._replied_at = time.monotonic()
        except zmq.ZMQError as exc:  # the peer went away or its queue is full
            logger.debug("reply to a control peer dropped: %s", exc)

    def _handle(self, identity: bytes, frame: bytes) -> proto.Message | None:
        try:
            msg = self.codec.decode(frame)
        except SignatureError as exc:
            self.stats.bad_signatures += 1
            self._warn("bad_signature", "refused control frame: %s", exc)
            return proto.Refused(-1, "", proto.Refusal.BAD_SIGNATURE, str(exc))
        except ProtocolError as exc:
            self.stats.protocol_errors += 1
            if len(frame) > self.codec.max_bytes:
                self.stats.oversized += 1
            self._warn("bad_message", "refused control frame: %s", exc)
            return proto.Refused(-1, "", proto.Refusal.BAD_MESSAGE, str(exc)[:MAX_REASON_CHARS])
        try:
            return self._dispatch(identity, msg)
        except Exception as exc:
            self.stats.internal_errors += 1
            logger.exception("fabric server failed on %s", type(msg).__name__)
            reason = f"{type(exc).__name__}: {exc}"[:MAX_REASON_CHARS]
            return proto.Refused(getattr(msg, "seq", -1), "", proto.Refusal.INTERNAL_ERROR, reason)

    def _dispatch(self, identity: bytes, msg: proto.Message) -> proto.Message | None:
        """The reply to ``msg``; None when it was deferred (see ``defer``)."""
        handler = self._handlers.get(type(msg))
        if handler is not None:
            return handler(identity, msg)
        if self._gate is not None:
            refused = self._gate(msg)
            if refused is not None:
                self.stats.refused += 1
                return refused
        if isinstance(msg, proto.Hello):
            return self._on_hello(identity, msg)
        if isinstance(msg, proto.Lookup | proto.Release | proto.Clear | proto.Pin):
            return self._on_tier(identity, msg)
        if isinstance(msg, proto.Stats):
            return proto.StatsReply(msg.seq, self.snapshot())
        if isinstance(msg, proto.PrefillState):
            return self._on_prefill_state(msg)
        if identity not in self._peers:
            self.stats.refused += 1
            return proto.Refused(
                getattr(msg, "seq", -1), "", proto.Refusal.NO_HELLO, "send Hello first"
            )
        self._peer_seen[identity] = time.monotonic()
        if isinstance(msg, proto.Reserve):
            return self._on_reserve(msg)
        if isinstance(msg, proto.Offer):
            return self._on_offer(identity, msg)
        if isinstance(msg, proto.Cancel):
            self.stats.cancels += 1
            self._end_reads(msg.request_id)
            self._forget(msg.request_id, expired=True)
            return proto.Ack(msg.seq, msg.request_id, self.store.cancel(msg.request_id))
        if isinstance(msg, proto.Heartbeat):
            ok = self.store.heartbeat(msg.request_id, msg.lease_ms)
            return proto.Ack(msg.seq, msg.request_id, ok)
        self.stats.protocol_errors += 1
        return proto.Refused(
            getattr(msg, "seq", -1), "", proto.Refusal.BAD_MESSAGE, "unexpected message"
        )

    def _on_hello(self, identity: bytes, msg: proto.Hello) -> proto.Message:
        if msg.fingerprint != self.fingerprint:
            self.stats.refused += 1
            reason = f"KV layout fingerprint {msg.fingerprint} != receiver's {self.fingerprint}"
            return proto.Refused(msg.seq, "", proto.Refusal.LAYOUT_MISMATCH, reason)
        if msg.transport != self.plane.kind:
            self.stats.refused += 1
            reason = f"sender uses {msg.transport}, receiver {self.plane.kind}"
            return proto.Refused(msg.seq, "", proto.Refusal.TRANSPORT_MISMATCH, reason)
        if msg.checksum != self.store.pool.checksum_name:
            # NOTE: each side hashes chunks where its pool lives (xxh3 on the
            # host, fold64 in VRAM); mixed, every chunk would fail to verify
            self.stats.refused += 1
            reason = (
                f"chunk checksum: the sender's pool hashes with {msg.checksum}, this "
                f"receiver's ({self.store.pool.device}) with {self.store.pool.checksum_name}; "
                + proto.CHECKSUM_HINT
            )
            return proto.Refused(msg.seq, "", proto.Refusal.LAYOUT_MISMATCH, reason)
        try:
            agent = self.plane.add_peer(msg.data_descriptor)
        except Exception as exc:
            self.stats.refused += 1
            return proto.Refused(msg.seq, "", proto.Refusal.BAD_DESCRIPTOR, str(exc))
        if agent != msg.agent_name:
            # NOTE: a sender named after another one would have that one's
            # cache read into its own slots (its regions, loaded from its Offers)
            self.stats.refused += 1
            reason = f"the descriptor is agent {agent!r}'s, the Hello says {msg.agent_name!r}"
            return proto.Refused(msg.seq, "", proto.Refusal.BAD_DESCRIPTOR, reason)
        self._peers[identity] = agent
        # NOTE: loading a descriptor resets the agent's regions in the plane,
        # for every connection of that agent: each one's next Offer loads them
        for other in [i for i, a in self._peers.items() if a == agent]:
            self._regions_of.pop(other, None)
        self._peer_seen[identity] = time.monotonic()
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
            pool.checksum_name,
            self._read_layout is not None,
        )

    def _on_reserve(self, msg: proto.Reserve) -> proto.Message:
        if len(msg.keys) != len(msg.nbytes) or not msg.keys:
            return self._refuse_reserve(msg, proto.Refusal.BAD_REQUEST, "keys/nbytes mismatch")
        if self.faults is not None and self.faults.roll("refuse"):
            self.stats.faults_injected += 1
            return self._refuse_reserve(msg, proto.Refusal.FAULT_INJECTED, "refused on purpose")
        with self._cond:
            abandoned = msg.request_id in self._abandoned
        if abandoned:
            return self._refuse_late(msg)
        try:
            res = self.store.reserve(msg.request_id, msg.keys, msg.nbytes, msg.lease_ms)
        except CapacityError as exc:
            return self._refuse_reserve(msg, proto.Refusal.CAPACITY, str(exc))
        except SlotStateError as exc:
            return self._refuse_reserve(msg, proto.Refusal.DUPLICATE, str(exc))
        except ValueError as exc:
            return self._refuse_reserve(msg, proto.Refusal.BAD_REQUEST, str(exc))
        expected = frozenset(i for i, hit in enumerate(res.already_present) if not hit)
        with self._cond:
            # NOTE: the consumer may have released it since the check above
            abandoned = msg.request_id in self._abandoned
            if not abandoned:
                self._progress[msg.request_id] = RequestProgress(msg.request_id, expected)
                self._ended.pop(msg.request_id, None)
                self._refusals.pop(msg.request_id, None)
                self._notify(msg.request_id)
        if abandoned:
            # NOTE: no sender ever learned these slots: free them now, not
            # past the lease (a reader's release waits that long)
            self.store.cancel(msg.request_id)
            return self._refuse_late(msg)
        self.stats.reservations += 1
        return proto.Reserved(
            msg.seq,
            msg.request_id,
            list(res.slots),
            list(res.generations),
            list(res.already_present),
            msg.lease_ms,
        )

    def _on_offer(self, identity: bytes, msg: proto.Offer) -> proto.Message | None:
        """READ an offered chunk into its slot (answered once the read ended,
        :meth:`_progress_reads`); Refused at once when there is nothing to
        read it into or from. The slot is held as being written until the
        read ended, so no lease's end frees it under the read.

        An offer of the chunk's leading layers (``Offer.layers``) reads the
        layers not read yet and, once read, counts them as a ``WritePart``
        would (the consumer may unpack them, :meth:`stream`); the chunk's
        final offer reads the rest and lands it with its checksum and the
        first byte it carried, so a consumer that unpacked the parts trusts
        its digest of them (:meth:`fill_streamed`)."""
        layout = self._read_layout
        if layout is None:
            return self._refuse_offer(msg, "this receiver does not read offered chunks")
        rid, index = msg.request_id, msg.index
        num_layers = layout.num_layers
        final = msg.layers in (0, num_layers)
        upto = num_layers if final else msg.layers
        if upto > num_layers:
            return self._refuse_offer(msg, f"{upto} layers offered, the layout has {num_layers}")
        with self._cond:
            prog = self._progress.get(rid)
            waiting = (
                prog is not None
                and index in prog.expected
                and not prog.finished
                and index not in prog.landed | prog.filled | prog.failed
            )
            first = prog.parts.get(index, 0) if prog is not None else 0
        if (
            not waiting
            or prog is None
            or any(r.offer.request_id == rid and r.offer.index == index for r in self._reads)
        ):
            return self._refuse_offer(msg, f"no chunk {index} of {rid!r} waits to be read")
        if first >= upto:
            return self._refuse_offer(
                msg, f"layers {first}..{upto} of chunk {index} of {rid!r}: nothing left to read"
            )
        res = self.store.reservation(rid)
        if res is None or index >= len(res.slots) or res.generations[index] != msg.generation:
            return self._refuse_offer(
                msg, f"chunk {index} of {rid!r} is not reserved at that generation"
            )
        slot, nbytes = res.slots[index], res.nbytes[index]
        if layout.chunk_nbytes(len(msg.block_ids)) != nbytes:
            return self._refuse_offer(
                msg,
                f"{len(msg.block_ids)} offered blocks do not hold chunk {index}'s {nbytes} bytes",
            )
        try:
            src = map_spans(msg.cache, layout, msg.block_ids)
        except LayoutError as exc:
            return self._refuse_offer(msg, str(exc))
        if src.nbytes != nbytes:
            return self._refuse_offer(
                msg, f"the offered blocks hold {src.nbytes} bytes, chunk {index} has {nbytes}"
            )
        if self._regions_of.get(identity) != msg.regions:
            # NOTE: the sender's cache is named to peers that passed its Hello
            # only, in its Offers, never in the descriptor every Hello carries
            try:
                self.plane.add_regions(self._peers[identity], msg.regions)
            except FabricError as exc:
                return self._refuse_offer(msg, f"the sender's cache: {exc}")
            self._regions_of[identity] = msg.regions
        pool = self.store.pool
        zero = np.zeros(1, dtype=np.int64)
        dst = Spans(zero, zero + pool.base_address + pool.slot_offset(slot), zero + nbytes, nbytes)
        try:
            plan = direct_plan(src, dst).layers(layout, len(msg.block_ids), first, upto)
            rows = plan.read_rows()
            writing = self.store.begin_write(rid, [(slot, msg.generation)])
        except (LayoutError, ValueError, ReservationExpired, SlotStateError) as exc:
            return self._refuse_offer(msg, str(exc))
        start = nbytes // num_layers * first
        span = nbytes // num_layers * upto - start
        try:
            handle = self.plane.post_read(self._peers[identity], rows, b"")
        except FabricError as exc:
            self.store.end_write(writing)
            self.stats.read_failures += 1
            self._fail_chunk(rid, index)
            return proto.Refused(
                msg.seq, rid, proto.Refusal.READ_FAILED, str(exc)[:MAX_REASON_CHARS]
            )
        self._reads.append(
            _Read(identity, msg, slot, span, handle, self._drained_at, upto, final, start, prog)
        )
        return None

    def _refuse_offer(self, msg: proto.Offer, reason: str) -> proto.Refused:
        self.stats.refused += 1
        self.stats.offers_refused += 1
        self._warn("offer", "refused an Offer of %s: %s", msg.request_id, reason)
        return proto.Refused(
            msg.seq, msg.request_id, proto.Refusal.BAD_REQUEST, reason[:MAX_REASON_CHARS]
        )

    def _progress_reads(self) -> None:
        """Answer the offered chunks whose READ ended; abort those past their
        bound (``write_timeout_ms``, at most 0.8 ``control_timeout_ms``: the
        sender waits no longer for the answer) or whose transfer ended
        (:meth:`_end_reads`). A chunk read is verified like a written one; a
        failed read fails its chunk (its load then fails at once, and vLLM
        recomputes). An exception ends that read only."""
        with self._cond:
            ending, self._reads_ending = self._reads_ending, set()
        now = time.monotonic()
        # NOTE: inside the sender's wait (the same control timeout, by default),
        # so it hears why rather than timing out
        limit = min(self.config.write_timeout_ms, 0.8 * self.config.control_timeout_ms) / 1000
        reads, self._reads = self._reads, []
        for read in reads:
            try:
                if not self._read_progressed(read, now, limit, read.offer.request_id in ending):
                    self._reads.append(read)
            except Exception:
                self.stats.internal_errors += 1
                logger.exception("READ of %s chunk %d", read.offer.request_id, read.offer.index)

    def _read_progressed(self, read: _Read, now: float, limit: float, ending: bool) -> bool:
        """Whether ``read`` ended (answered, its slot's write ended)."""
        why = ""
        try:
            state = read.handle.poll()
        except Exception as exc:
            state, why = XferState.ERR, f"{type(exc).__name__}: {exc}"
        if state is XferState.PROC and not ending and now - read.started <= limit:
            return False
        try:
            if state is XferState.PROC:
                why = "its transfer ended" if ending else f"not done in {limit:.1f} s"
                # NOTE: an abort that cannot promise no more bytes land leaves
                # them to the slot's quarantine (the chunk is never filled)
                read.handle.abort()
                state = XferState.ERR
            else:
                read.handle.release()
        finally:
            self.store.end_write([read.slot])
            self._read_ended(read, state is XferState.DONE, why or "the READ failed")
        return True

    def _read_ended(self, read: _Read, ok: bool, why: str) -> None:
        offer = read.offer
        if not ok:
            self.stats.read_failures += 1
            self._warn("read", "READ of %s chunk %d failed: %s", offer.request_id, offer.index, why)
            self._fail_chunk(offer.request_id, offer.index)
            reason = f"chunk {offer.index}: {why}"[:MAX_REASON_CHARS]
            self._reply(
                read.identity,
                proto.Refused(offer.seq, offer.request_id, proto.Refusal.READ_FAILED, reason),
            )
            return
        self.stats.bytes_read += read.nbytes
        # NOTE: the sender may reuse its blocks from here on: what it offered is here
        self._reply(read.identity, proto.Ack(offer.seq, offer.request_id, True))
        if not read.final:
            self.stats.parts_read += 1
            # NOTE: not in a transfer reserved anew meanwhile: its slot is another
            self._part_landed(offer.request_id, offer.index, read.upto, read.prog)
            return
        self.stats.chunks_read += 1
        landed = proto.WriteDone(
            offer.request_id, [offer.index], [offer.generation], [offer.checksum], [read.start]
        )
        with self._cond:
            prog = self._progress.get(offer.request_id)
            if prog is not None:
                prog.landed.add(offer.index)
                self._notify(offer.request_id)
        self._verify_q.put(landed)

    def _fail_chunk(self, request_id: str, index: int) -> None:
        with self._cond:
            prog = self._progress.get(request_id)
            if prog is not None:
                prog.failed.add(index)
                self._notify(request_id)

    def _end_reads(self, request_id: str) -> None:
        """Abort the READs of ``request_id`` still running (its consumer
        released it, or its sender cancelled it): the loop does it next."""
        with self._cond:
            self._reads_ending.add(request_id)

    def _refuse_reserve(self, msg: proto.Reserve, code: str, reason: str) -> proto.Refused:
        """Refuse ``msg``; a load waiting for its transfer is told at once."""
        self.stats.refused += 1
        with self._cond:
            # NOTE: not for a transfer with a reservation (a duplicate Reserve): its load goes on
            if msg.request_id not in self._progress:
                refused = (time.monotonic(), f"{code}: {reason}")
                _remember(self._refusals, msg.request_id, refused)
                self._notify(msg.request_id)
        return proto.Refused(msg.seq, msg.request_id, code, reason)

    def _refuse_late(self, msg: proto.Reserve) -> proto.Refused:
        self.stats.refused += 1
        self.stats.reserves_late += 1
        reason = "its load already ended (it stopped waiting, or its request ended)"
        return proto.Refused(msg.seq, msg.request_id, proto.Refusal.RELEASED, reason)

    def _on_prefill_state(self, msg: proto.PrefillState) -> proto.Message:
        """Record the proxy's word on the prefills of ``msg.request_ids``
        (the loader reads it: :meth:`prefill_note`). ``done`` and ``failed``
        are final; past ``MAX_PREFILL_NOTES`` new transfers are not recorded."""
        if msg.state not in proto.PREFILL_STATES:
            self.stats.refused += 1
            reason = f"prefill state {msg.state[:64]!r} is not one of {proto.PREFILL_STATES}"
            return proto.Refused(msg.seq, "", proto.Refusal.BAD_REQUEST, reason)
        now = time.monotonic()
        until = now + min(msg.ttl_ms / 1000, MAX_RUNNING_S)
        note = PrefillNote(msg.state, now, until, msg.reason[:MAX_REASON_CHARS])
        recorded = full = late = 0
        with self._cond:
            for rid in msg.request_ids:
                old = self._prefills.get(rid)
                if old is not None and old.state != "running":
                    late += 1
                    continue  # NOTE: final (or released); a late word changes nothing
                if old is None and len(self._prefills) >= MAX_PREFILL_NOTES:
                    full += 1
                    continue
                self._prefills[rid] = note
                recorded += 1
            if recorded:
                self._notify(*msg.request_ids)
        self.stats.prefill_notes += recorded
        self.stats.prefill_notes_late += late
        if full:
            self._warn(
                "prefill_notes", "%d prefill notes not kept: %d kept", full, len(self._prefills)
            )
        return proto.Done(msg.seq, recorded)

    def _prune_prefills(self, now: float) -> None:
        """Every ``PRUNE_PREFILLS_S``: drop the notes that ran out (or were
        final) ``PREFILL_NOTE_LINGER_S`` ago, released ones ``RELEASED_LINGER_S``
        ago, transfers released before they came ``ABANDONED_LINGER_S`` ago,
        and refusals ``REFUSED_LINGER_S`` ago."""
        if now < self._next_prefill_prune:
            return
        self._next_prefill_prune = now + PRUNE_PREFILLS_S
        with self._cond:
            stale = [rid for rid, note in self._prefills.items() if _note_stale(note, now)]
            for rid in stale:
                del self._prefills[rid]
            _forget_older(self._abandoned, now - ABANDONED_LINGER_S, lambda at: at)
            _forget_older(self._refusals, now - REFUSED_LINGER_S, lambda refused: refused[0])

    def _notify(self, *request_ids: str | None) -> None:
        """Wake the waiters; the transfers that changed (None: any may have).
        Caller holds ``_cond``."""
        self._events += 1
        if self._dirty is not None:
            if None in request_ids:
                self._dirty = None
            else:
                self._dirty.update(rid for rid in request_ids if rid is not None)
        self._cond.notify_all()

    def snapshot(self) -> dict[str, int]:
        """Store occupancy and every counter, flat (``Stats`` answers with it)."""
        out: dict[str, int] = {
            "slot_bytes": self.store.pool.slot_bytes,
            "num_slots": self.store.pool.num_slots,
        }
        out |= {k: int(v) for k, v in dataclasses.asdict(self.store.stats()).items()}
        out |= {f"server_{k}": int(v) for k, v in dataclasses.asdict(self.stats).items()}
        out |= {f"plane_{k}": v for k, v in self.plane.counters().items()}
        for extra in self.extra_stats:
            out |= extra()
        out["server_offload_busy"] = self._offload.busy
        out["server_admin_busy"] = self._admin.busy
        out |= {TABLES_PREFIX + name: n for name, n in self.table_sizes().items()}
        tier = self.tier
        if tier is not None:
            out["holds"] = tier.held_count()
            out |= {f"tier_{k}": int(v) for k, v in dataclasses.asdict(tier.counters).items()}
            if tier.disk is not None:
                disk = dataclasses.asdict(tier.disk.stats())
                out |= {f"disk_{k}": int(v) for k, v in disk.items()}
        return out

    def _on_tier(self, identity: bytes, msg: TierRequest) -> proto.Message | None:
        """Lookups and admin for the reuse tier: asked by this engine's
        scheduler and by the proxy, so no Hello is needed. What may touch the
        disk runs off the loop."""
        tier = self.tier
        if tier is None:
            self.stats.refused += 1
            return proto.Refused(
                msg.seq, "", proto.Refusal.NO_TIER, "this engine keeps no reuse tier"
            )
        if isinstance(msg, proto.Lookup):
            self.stats.lookups += 1
        if not blocks(tier, msg):
            reply = tier_reply(tier, msg)
            if isinstance(reply, proto.Refused):
                self.stats.refused += 1
            return reply
        return self.defer(identity, msg.seq, lambda: tier_reply(tier, msg), admin=is_admin(msg))

    def answers_lookups_here(self) -> bool:
        """Whether :meth:`answer_here` may answer a Lookup: a reuse tier
        with no disk (a hold never reads a file)."""
        return self.tier is not None and self.tier.disk is None

    def answer_here(self, msg: TierRequest) -> proto.Message:
        """The reply to ``msg`` on the caller's thread, for a scheduler in
        this process (no socket, no wait); only for what touches no disk.
        Counted in ``lookups_in_process`` (a lookup), not ``lookups``; a
        bug is answered ``internal_error``, as over the socket."""
        tier = self.tier
        assert tier is not None and not blocks(tier, msg), "ask over the socket"
        if isinstance(msg, proto.Lookup):
            self.stats.lookups_in_process += 1
        try:
            reply = tier_reply(tier, msg)
            if self._sleeping_empty and tier.held_count():
                self._admin.wake()  # NOTE: a hold's lease to expire: tick at the idle interval
            return reply
        except Exception as exc:
            self.stats.internal_errors += 1
            logger.exception("fabric server failed on %s asked in process", type(msg).__name__)
            reason = f"{type(exc).__name__}: {exc}"[:MAX_REASON_CHARS]
            return proto.Refused(msg.seq, "", proto.Refusal.INTERNAL_ERROR, reason)

    def _on_notif(self, peer: str, frame: bytes) -> None:
        try:
            msg = self.codec.decode(frame, fresh=False)  # NOTE: stamped when posted
        except SignatureError as exc:
            self.stats.bad_signatures += 1
            self._warn("bad_notif", "dropped notification from %s: %s", peer, exc)
            return
        except ProtocolError as exc:
            self.stats.protocol_errors += 1
            self._warn("bad_notif", "dropped notification from %s: %s", peer, exc)
            return
        if isinstance(msg, proto.WritePart):
            self._part_landed(msg.request_id, msg.index, msg.layers)
            return
        if not isinstance(msg, proto.WriteDone):
            self.stats.protocol_errors += 1
            return
        with self._cond:
            prog = self._progress.get(msg.request_id)
            if prog is not None:
                prog.landed.update(msg.indices)
                self._notify(msg.request_id)
        self._verify_q.put(msg)

    def _part_landed(
        self, request_id: str, index: int, layers: int, within: RequestProgress | None = None
    ) -> None:
        """The leading ``layers`` layers of chunk ``index`` landed (written or
        read; ``within``: only into that progress of the transfer)."""
        with self._cond:
            prog = self._progress.get(request_id)
            if prog is not None and index in prog.expected and (within is None or within is prog):
                prog.parts[index] = max(prog.parts.get(index, 0), layers)
                self.stats.parts_landed += 1
                self._notify(request_id)

    def _warn(self, kind: str, message: str, *args: object) -> None:
        """A warning about bad input, at most one per ``WARN_EVERY_S`` per kind
        (a flood of bad frames must not flood the log); DEBUG for the rest."""
        now = time.monotonic()
        if now - self._warned.get(kind, -WARN_EVERY_S) < WARN_EVERY_S:
            logger.debug(message, *args)
            return
        self._warned[kind] = now
        logger.warning(message + " (more like it: DEBUG for %.0f s)", *args, WARN_EVERY_S)

    def _prune_peers(self, now: float) -> None:
        """Forget senders silent for ``peer_idle_s``.

        ZMQ does not say which identity went away, so a sender that
        restarted (new identity, new agent) would otherwise stay in the
        table and in the data plane forever. A pushing sender heartbeats,
        so an idle one has nothing in flight; if it comes back its link
        gets ``no_hello`` and says Hello again.
        """
        limit = now - self.config.peer_idle_s
        for identity in [i for i, seen in self._peer_seen.items() if seen < limit]:
            del self._peer_seen[identity]
            self._regions_of.pop(identity, None)
            agent = self._peers.pop(identity, None)
            self.stats.peers_pruned += 1
            if agent is not None and agent not in self._peers.values():
                self.plane.remove_peer(agent)

    def _expire(self) -> None:
        now = time.monotonic()
        if now >= self._next_prune:
            self._prune_peers(now)
            self._next_prune = now + min(1.0, self.config.peer_idle_s / 4)
        self.stats.expired += self.store.expire()
        if self.tier is not None:
            self.tier.expire_holds()
        self._end_gone(now)
        self._prune_prefills(now)

    def _end_gone(self, now: float) -> None:
        """Progress whose reservation the store no longer holds (its lease ran
        out: nobody loaded it, e.g. no load was ever planned for it): mark it
        expired at once, drop it ``ENDED_LINGER_S`` later."""
        with self._cond:
            gone = [rid for rid in self._progress if not self.store.has_reservation(rid)]
            changed = False
            for rid in gone:
                prog = self._progress[rid]
                if not prog.finished:
                    prog.expired = changed = True
                if now - self._ended.setdefault(rid, now) >= ENDED_LINGER_S:
                    del self._progress[rid], self._ended[rid]
                    changed = True
            if changed:
                self._notify(*gone)

    def _forget(self, request_id: str, *, expired: bool) -> None:
        self._end_reads(request_id)
        with self._cond:
            prog = self._progress.pop(request_id, None)
            self._ended.pop(request_id, None)
            if prog is not None and expired:
                prog.expired = True
            self._notify(request_id)

    # ------------------------------------------------------------ verifier
    def _verify(self) -> None:
        while (msg := self._verify_q.get()) is not None:
            starts = msg.starts if len(msg.starts) == len(msg.indices) else [0] * len(msg.indices)
            for index, checksum, generation, start in zip(
                msg.indices, msg.checksums, msg.generations, starts, strict=False
            ):
                with self._cond:
                    prog = self._progress.get(msg.request_id)
                    if prog is not None and index in prog.streamed:
                        prog.sealed[index] = (checksum, generation, start)  # NOTE: consumer hashes
                        self._notify(msg.request_id)
                        continue
                    if prog is not None:
                        prog.verifying.add(index)
                try:
                    self._fill_one(msg.request_id, index, checksum, generation)
                except Exception:
                    self.stats.internal_errors += 1
                    logger.exception("verifying %s chunk %d failed", msg.request_id, index)
                finally:
                    if prog is not None:
                        with self._cond:
                            prog.verifying.discard(index)

    def _fill_one(
        self,
        request_id: str,
        index: int,
        checksum: int,
        generation: int,
        *,
        actual: int | None = None,
        slot: int | None = None,
    ) -> None:
        ok = False
        try:
            self.store.fill(request_id, index, checksum, generation, actual=actual, slot=slot)
            ok = True
        except ChecksumMismatch as exc:
            self.stats.checksum_failures += 1
            logger.warning("request %s chunk %d: %s", request_id, index, exc)
        except (ReservationExpired, SlotStateError) as exc:
            self.stats.late_writes += 1
            self._warn("late_write", "ignored write for %s chunk %d: %s", request_id, index, exc)
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
            self._notify(request_id)


def _note_stale(note: PrefillNote, now: float) -> bool:
    if note.state == "released":
        return now - note.at > RELEASED_LINGER_S
    end = note.until if note.state == "running" else note.at
    return now - end > PREFILL_NOTE_LINGER_S


def _remember(table: dict[str, _T], key: str, value: _T) -> None:
    """Under ``_cond``: (re)insert ``key`` as the newest entry of ``table``,
    forgetting the oldest past ``MAX_ABANDONED``."""
    table.pop(key, None)
    table[key] = value
    while len(table) > MAX_ABANDONED:
        del table[next(iter(table))]


def _forget_older(table: dict[str, _T], before: float, at: Callable[[_T], float]) -> None:
    """Under ``_cond``: drop the entries of ``table`` (oldest first) made
    before ``before`` (``at``: when an entry was made)."""
    while table:
        key, value = next(iter(table.items()))
        if at(value) >= before:
            return
        del table[key]
