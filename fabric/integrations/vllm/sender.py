"""Prefiller's push threads: reserve on the decoder, WRITE chunks as packed.

The model thread packs a chunk into a store slot at the end of the step
that computed it and hands (request, chunk index, slot) over; the push
threads own every network call, so a slow or dead decoder never blocks a
model step. Failures are logged and counted; the decoder then times out
(or is told by a Cancel) and recomputes.

Pushes to different receivers are independent: a dispatcher thread routes
each request's events to the thread of its receiver's endpoint, which
reserves, writes, polls, heartbeats and cancels for that endpoint only::

    model thread --begin/chunk/finished/fail--> dispatcher (``name``)
                                                 | one queue per endpoint
                          +----------------------+---------------+
                          v                      v               v
                  "name:tcp://d1"        "name:tcp://d2"       ...
                  (its jobs: Reserve, WRITE, poll, Heartbeat, Cancel)

With ``layer_writes`` the pack thread also hands over ``part`` events: a
chunk's leading layers packed during the forward, in a slot not yet
committed (no ref: the chunk's own ``chunk`` event comes later, or its
request fails). Once the push has its Reserve, the endpoint's thread writes
what was packed beyond what it wrote (``PeerLink.write_part``), one write
per chunk in flight (the receiver admits one write into a slot at a time;
parts packed meanwhile go in the next one). The chunk's own write then
sends only the rest, once its last part completed, and only when it comes
from the same slot (else the whole chunk: the receiver's digest of the
parts then fails and it verifies the slot whole).

A receiver that accepts the connection and never answers stalls only its
own thread (each call bounded by the client's control timeout), never the
pushes to the others, which reach their decoders within its grace.

A receiver that failed (no answer, a failed write or handshake; not a
refusal, which is a live answer) is backed off: for a while every push to it
fails at once, counted as a failure, its slots released here as its chunks
come, and nothing about the request is kept (the decoder falls back to
computing after its grace). Meanwhile its thread asks it for its Stats every
``PROBE_EVERY_S`` (one control call, bounded by the control timeout; only
while no push it granted earlier is still served, and not for the shared
store); the first answer ends the backoff, once per backoff level, so a
receiver back from a partition or a restart gets the next push (not only
once a backoff of up to ``backoff_s`` ran out). The backoff starts at ``FIRST_BACKOFF_S`` and
doubles up to ``backoff_s``, once per incident: a call that began before
the running backoff ended (the other pushes one outage caught) fails its
push without extending it; a completed push resets it. An error from a
link that is no longer the client's link to the endpoint (closed meanwhile)
says nothing about the receiver: that push fails, nothing else changes.

A control call that timed out rebuilds the link's control socket and no
more: the link and its data-plane peer stay, so the other pushes' writes to
that receiver go on. They are dropped only while no write to the endpoint
is in flight: once its backoff reached ``backoff_s`` (dead for a while), or
when its thread ends. A Cancel never waits for its answer (queued on the
link, sent as soon as the socket takes it, for up to a lease); a Reserve
that got no answer is cancelled too, since the receiver may have granted it
late and would hold the slots (and its loader wait) for nothing.

At most ``max_waiting`` pushes per receiver wait for their Reserve; more
fail at once. Their chunks are released unwritten (those queued and each
one that comes) and the push fails when either holds:

- the push was admitted ``max_unsettled_s`` ago and its Reserve has not
  been answered (time queued behind the receiver's other Reserves counts:
  they go one at a time, so a receiver that answers each just before the
  control timeout would otherwise keep the last of 64 pushes' chunks for
  minutes, long after its decoder stopped waiting);
- the endpoint's thread has waited ``stall_s`` in one control call (a
  silent receiver's Hello, a Reserve or heartbeat it does not answer) while
  the store is short of slots: fewer than max(``STALL_PRESSURE`` of them,
  ``MIN_FREE_SLOTS``) could be allocated now. This is checked as each chunk
  is handed over, of any push while some receiver was stalled at the last
  tend (every ``_TEND_EVERY_S``) and of a push to a receiver stalled now,
  and at each tend; it releases every stalled receiver's waiting pushes.

So a receiver that is only slow (a busy host answers a Reserve in a second
or three) keeps the pushes it gets to within ``max_unsettled_s`` while the
store has room; one that never answers holds at most the chunks packed in
``max_unsettled_s`` (those of the pushes it had granted aside), and none
once the other pushes need the slots. At most ``MAX_PEERS`` endpoints have
a thread at a time; a push to another fails at once.

Every table is pruned when its request ends however it ends (pushed,
failed, timed out, finished early); an endpoint's thread ends, and its link
is dropped, once it has had nothing to do for ``peer_idle_s`` (its backoff
forgotten then). :meth:`PushSender.table_sizes` reports the sizes.

An exception while serving one event or job fails that job only (counted as
``thread_errors``, its slots released); the thread keeps serving the others.

A second instance pushes the same chunks into the host's shared store
(:class:`SenderCounters` names its counters and tables, ``prepare``
attaches before the first Reserve): on its own threads, so a slow shared
store never delays a push to a decoder.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fabric.errors import (
    FabricError,
    ReservationExpired,
    ReservationRefused,
    TransferTimeout,
)
from fabric.threads import thread as named_thread
from fabric.transfer.client import ChunkOffer

if TYPE_CHECKING:
    from fabric.integrations.vllm.counters import FabricCounters
    from fabric.integrations.vllm.paths import PathChooser
    from fabric.kv.direct import CacheMap
    from fabric.store import ChunkStore
    from fabric.transfer import PeerLink, PendingPush, RemoteReservation, TransferClient

logger = logging.getLogger(__name__)

FIRST_BACKOFF_S = 1.0
MAX_WAITING = 64
MAX_PEERS = 256
PEER_IDLE_S = 60.0
STALL_S = 1.0
STALL_PRESSURE = 0.25
"""Below this fraction of allocatable store slots, a stalled receiver's waiting chunks go."""
MAX_OFFER_BATCH = 16
"""The most offers of one push queued together that go as one round trip
(``PeerLink.offer_many``): a step's chunks' final offers reach a push
thread while it waits for the last answer; a layer group's parts of a
step's chunks come as one event (``PushSender.offer_parts``)."""
UNMEASURED_RATE = float(128 << 20)
"""The read rate (bytes a second) a receiver's batches of offers are sized
by before one was measured (``PushSender._batch_bytes``): 64 MiB a batch at
the default control timeout."""
MAX_OFFER_BATCH_BYTES = 256 << 20
"""...and bytes the receiver reads for them at most (the layers not offered
before: a part's, or a chunk's rest): it reads them all at once."""
_NO_EVENT = object()  # NOTE: _take_offers: nothing queued after the offers
IDLE_ROUND_S = 0.5
"""The longest an endpoint's thread with nothing to poll waits for an event (``_idle_s``)."""
PART_POLL_S = 0.001
"""How often a part in flight is polled while no chunk's last write is (see ``_round``)."""
MIN_FREE_SLOTS = 8
"""...and below this many allocatable slots, whatever the fraction (small stores)."""
PROBE_EVERY_S = 1.0
"""How often a backed-off receiver is asked whether it answers again."""
MAX_UNSETTLED_S = 5.0
"""The longest a push's chunks wait for its Reserve, from its admission (a decoder
gives up on a transfer it has not heard of after ``unknown_transfer_grace_s``, 2 s
by default; one that claimed it waits longer)."""
_TEND_EVERY_S = 0.5


@dataclass(frozen=True)
class SenderCounters:
    """Which counters a sender adds to and how its tables are named.

    ``count_present``: a chunk the receiver already had counts as sent (a
    decoder push) or not (the shared store, where only the chunks it lacked
    are news). ``tables``: prefix of the names in ``table_sizes``;
    ``client_tables``: whether they include the transfer client's (links,
    leases, data-plane peers), which senders sharing a client report once.
    """

    sent: str = "chunks_sent"
    bytes: str = "bytes_sent"
    failures: str = "push_failures"
    count_present: bool = True
    write_seconds: str | None = "chunk_write_seconds"
    tail_seconds: str | None = "push_tail_seconds"
    tables: str = "sender"
    client_tables: bool = True


SHARED_STORE_COUNTERS = SenderCounters(
    sent="shared_store_saved_chunks",
    bytes="shared_store_saved_bytes",
    failures="shared_store_failures",
    count_present=False,
    write_seconds=None,
    tail_seconds=None,
    tables="shared_sender",
    client_tables=False,
)


@dataclass(eq=False)
class PushJob:
    req_id: str
    transfer_id: str
    endpoint: str
    keys: list[bytes]
    nbytes: list[int]
    link: PeerLink | None = None
    res: RemoteReservation | None = None
    failed: bool = False
    written: int = 0
    finished: bool = False  # the scheduler is done with the request
    inflight: list[tuple[int, PendingPush, float]] = field(default_factory=list)
    last_heartbeat: float = 0.0
    dropped: bool = False  # forgotten by its endpoint's thread
    asked: bool = False  # a Reserve went out without a refusal back: cancel it on failure
    settled: bool = False  # its Reserve was answered or given up (endpoint thread)
    admitted_at: float = 0.0  # when the dispatcher handed it to its endpoint's thread
    # The dispatcher's: chunk refs handed over before it settled, and whether
    # they were released unwritten (the receiver stalled).
    early: list[_SlotRef] = field(default_factory=list)
    starved: bool = False
    parts: dict[int, _Part] = field(default_factory=dict)  # chunk -> its parts (endpoint thread)
    # chunk -> its leading layers offered so far (a later offer reads only the rest)
    offered_layers: dict[int, int] = field(default_factory=dict)
    # direct_reads auto: the path it takes ("staged", "direct"; "": not measured),
    # the CPU the pack thread (pack_cpu_s, before handing each chunk over) and
    # its endpoint's thread (link_cpu_s) spent on it, and when its last chunk
    # was handed over (the dispatcher's; the push's tail runs from there)
    path: str = ""
    pack_cpu_s: float = 0.0
    link_cpu_s: float = 0.0
    tail_from: float = 0.0
    settled_at: float = 0.0  # its Reserve answered (a link's first also connected)
    ended_at: float = 0.0  # dropped (its tail ends here)
    path_failed: bool = False  # a write, offer or READ of it failed (not an abort)

    @property
    def complete(self) -> bool:
        return self.written == len(self.keys) and not self.inflight

    @property
    def tail_s(self) -> float:
        """From its last chunk's hand-over, or its Reserve's answer if later (a
        link's first push also connected), to its drop; 0 before both."""
        if not self.tail_from or not self.ended_at:
            return 0.0
        return self.ended_at - max(self.tail_from, self.settled_at)

    @property
    def parts_running(self) -> bool:
        return any(p.pending is not None for p in self.parts.values())

    @property
    def finals_waiting(self) -> bool:
        """A chunk's last write waits for its part in flight (polled closely)."""
        return any(p.final is not None for p in self.parts.values())


@dataclass(eq=False)
class _Part:
    """The leading layers of one chunk written before it was packed whole.

    ``slot``: where the prefiller packs it (not committed: no ref is held;
    its writes only read it); ``landed``: the bytes whose write completed;
    ``want``: (layers, bytes) packed so far; ``pending``: the one write in
    flight (a receiver admits one write into a slot at a time) and the
    ``(layers, bytes)`` it brings; ``final``: the chunk's committed slot
    (a ref held), its write waiting for ``pending`` to end; ``epoch``: the
    link's route epoch ``landed`` went over (a route loaded again since
    counts nothing as landed); ``void``: the prefiller gave the slot back
    (its layer-wise pack failed, or the chunk was present meanwhile):
    nothing more is written from it and the chunk goes whole."""

    slot: int
    landed: int = 0
    want: tuple[int, int] = (0, 0)
    pending: tuple[PendingPush, tuple[int, int], float] | None = None
    final: int | None = None
    epoch: int = -1
    void: bool = False
    rewrote: bool = False  # a part went again over bytes written before: the chunk goes whole


class _SlotRef:
    """A chunk's slot ref on its way to the endpoint's thread: taken once,
    by that thread (to write it) or by the dispatcher (to release it)."""

    def __init__(self, slot: int) -> None:
        self._slot: int | None = slot
        self._lock = threading.Lock()

    def take(self) -> int | None:
        """The slot, to the first caller; None after."""
        with self._lock:
            slot, self._slot = self._slot, None
            return slot


Event = tuple[str, object]


class _Peer:
    """One receiver endpoint: its queue, thread, jobs and backoff.

    The dispatcher writes ``admitted``; the endpoint's thread everything
    else (the dispatcher only reads).
    """

    def __init__(
        self, endpoint: str, target: Callable[[_Peer], None], name: str, os_name: str
    ) -> None:
        self.endpoint = endpoint
        self.events: queue.Queue[Event | None] = queue.Queue()
        self.jobs: dict[int, PushJob] = {}  # id(job) -> job
        self.admitted = self.settled = self.dropped = 0
        self.backoff_s, self.backoff_until = 0.0, 0.0
        self.next_probe = 0.0  # when a backed-off receiver is asked again whether it answers
        self.probed_s = 0.0  # the backoff level a probe's answer last ended early
        self.last_active = time.monotonic()
        self.stopped = self.saturated = False
        self.calling_since = 0.0  # when its current control call began (0: in none)
        self.cancelling: set[PeerLink] = set()  # links with Cancels still to send
        self.ended: list[PushJob] = []  # measured pushes over, to record (its thread's)
        self.read_bps = 0.0  # how fast it read offered chunks lately (0: not yet measured)
        self.thread = named_thread(target, args=(self,), name=name, os_name=os_name)

    @property
    def waiting(self) -> int:
        """Jobs handed over whose Reserve has not been answered yet."""
        return self.admitted - self.settled

    def backed_off(self, now: float) -> bool:
        return now < self.backoff_until

    def back_off(self, now: float, max_s: float) -> None:
        self.backoff_s = min(max_s, 2 * self.backoff_s or FIRST_BACKOFF_S)
        self.backoff_until = now + self.backoff_s
        self.next_probe = now + PROBE_EVERY_S  # NOTE: not at once: the failed call's Cancel first

    def news(self, started: float) -> bool:
        """Whether a failure of a call begun at ``started`` is a new incident:
        one begun before the running (or last) backoff ended is not."""
        return started >= self.backoff_until

    @contextlib.contextmanager
    def calling(self) -> Iterator[None]:
        """Around a blocking control call (see ``stalled``)."""
        self.calling_since = time.monotonic()
        try:
            yield
        finally:
            self.calling_since = 0.0

    def stalled(self, now: float, stall_s: float) -> bool:
        """Whether the thread has waited over ``stall_s`` in one control call."""
        since = self.calling_since
        return bool(since) and now - since > stall_s

    def idle(self, now: float, idle_s: float) -> bool:
        return (
            self.admitted == self.dropped
            and self.events.empty()
            and now - self.last_active > idle_s
            and not self.backed_off(now)
        )


class PushSender:
    """Reserves, writes and tracks every push: a dispatcher thread and one
    thread per receiver endpoint (see the module docstring)."""

    def __init__(
        self,
        client: TransferClient,
        store: ChunkStore,
        counters: FabricCounters,
        *,
        lease_ms: int,
        push_timeout_s: float,
        names: SenderCounters = SenderCounters(),
        prepare: Callable[[str], None] | None = None,
        backoff_s: float = 30.0,
        max_waiting: int = MAX_WAITING,
        peer_idle_s: float = PEER_IDLE_S,
        stall_s: float = STALL_S,
        max_unsettled_s: float = MAX_UNSETTLED_S,
        name: str = "fabric-push",
        cache: CacheMap | None = None,
        num_layers: int = 0,
        on_over: Callable[[str], None] | None = None,
        paths: PathChooser | None = None,
    ) -> None:
        self.client, self.store, self.counters = client, store, counters
        self.lease_ms, self.push_timeout_s = lease_ms, push_timeout_s
        self.names, self.prepare, self.backoff_s = names, prepare, backoff_s
        self.max_waiting, self.peer_idle_s, self.name = max_waiting, peer_idle_s, name
        self.stall_s, self.max_unsettled_s = stall_s, max_unsettled_s
        self.cache, self.on_over, self.paths = cache, on_over, paths
        self.num_layers = num_layers  # NOTE: the cache's (0: unknown): what an offer reads
        self._stalled: set[str] = set()  # endpoints stalled at the last tend (dispatcher's)
        self._events: queue.Queue[Event] = queue.Queue()
        self._jobs: dict[str, PushJob] = {}  # req_id -> its live job (for routing)
        self._jobs_lock = threading.Lock()
        self._peers: dict[str, _Peer] = {}  # endpoint -> its thread's state
        self._peers_lock = threading.Lock()
        self._next_tend = 0.0
        self._stop = threading.Event()
        self.os_prefix = (
            "fpush" if name == "fabric-push" else "f" + name.removeprefix("fabric-")[:6]
        )
        self._thread = named_thread(self._run, name=name, os_name=self.os_prefix)
        self._thread.start()

    # ---------------------------------------------------------- model thread
    def begin(self, job: PushJob) -> None:
        self._events.put(("begin", job))

    def chunk(self, req_id: str, index: int, slot: int) -> None:
        """Chunk ``index`` is packed in ``slot`` (a ref is held; we release it)."""
        self._events.put(("chunk", (req_id, index, slot, time.monotonic())))

    def offer(
        self, req_id: str, index: int, block_ids: list[int], checksum: int, layers: int = 0
    ) -> None:
        """Chunk ``index`` is final in this engine's cache blocks ``block_ids``
        (held by vLLM until the request's push is over: ``on_over``), with
        ``checksum``: offered to the receiver, which READs it (direct reads).
        ``layers`` > 0: only its leading ``layers`` layers are final yet (a
        part, offered during the forward; no checksum); its final offer follows,
        or its request fails."""
        self._events.put(("offer", (req_id, index, block_ids, checksum, time.monotonic(), layers)))

    def offer_parts(self, req_id: str, parts: Sequence[tuple[int, list[int], int]]) -> None:
        """:meth:`offer` of the leading layers of several chunks of one push
        (``(index, block_ids, layers)`` each, every chunk once): one event,
        so they go to the receiver together, one round trip for as many as
        ``MAX_OFFER_BATCH`` and ``_batch_bytes`` allow, rather than one by
        one as the push thread wakes (a layer group of a request's chunks,
        hashed during the forward)."""
        if parts:
            now = time.monotonic()
            batch = [(index, block_ids, 0, now, layers) for index, block_ids, layers in parts]
            self._events.put(("offers", (req_id, batch)))

    def part(self, req_id: str, index: int, slot: int, layers: int, nbytes: int) -> None:
        """Chunk ``index``'s leading ``layers`` layers (its first ``nbytes``
        bytes) are packed in ``slot``, the rest still to come: written at
        once when the push has its Reserve (no ref is handed over; the
        chunk's own ``chunk`` event follows, or its request fails)."""
        self._events.put(("part", (req_id, index, slot, layers, nbytes)))

    def part_dropped(self, req_id: str, index: int) -> None:
        """The slot whose parts of chunk ``index`` were handed over went back
        to the store: no more writes from it; the chunk is written whole."""
        self._events.put(("unpart", (req_id, index)))

    def finished(self, req_ids: set[str]) -> None:
        for rid in req_ids:
            self._events.put(("finished", rid))

    def fail(self, req_id: str, why: str) -> None:
        """Give the push of ``req_id`` up (a chunk could not be packed)."""
        self._events.put(("fail", (req_id, why)))

    def close(self) -> None:
        self._stop.set()
        self._events.put(("stop", None))  # NOTE: wakes the dispatcher now
        self._thread.join(timeout=10)
        with self._peers_lock:
            peers, self._peers = list(self._peers.values()), {}
        for peer in peers:
            peer.events.put(None)
        deadline = time.monotonic() + 10
        for peer in peers:
            peer.thread.join(timeout=max(0.0, deadline - time.monotonic()))

    @property
    def thread(self) -> threading.Thread:
        """The dispatcher thread (for health: whether it still runs)."""
        return self._thread

    def table_sizes(self) -> dict[str, int]:
        """Current entries of the per-request and per-peer tables (any thread)."""
        with self._jobs_lock:
            jobs = len(self._jobs)
        with self._peers_lock:
            peers = list(self._peers.values())
        prefix = self.names.tables
        sizes = {
            f"{prefix}_jobs": jobs,
            f"{prefix}_queued": self._events.qsize() + sum(p.events.qsize() for p in peers),
            f"{prefix}_peers": len(peers),
        }
        if self.names.client_tables and self.client is not None:
            for table, n in self.client.table_sizes().items():
                sizes[f"sender_{table}"] = n
        return sizes

    # ---------------------------------------------------------- dispatcher
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                event = self._events.get(timeout=_TEND_EVERY_S)
            except queue.Empty:
                event = None
            try:
                if event is not None:
                    self._dispatch(*event)
                self._tend()
            except Exception:  # NOTE: the routing of one event; keep serving
                self.counters.add(thread_errors=1)
                kind = event[0] if event is not None else "housekeeping"
                logger.exception("%s: dispatching %s failed; continuing", self.name, kind)

    def _dispatch(self, kind: str, payload: object) -> None:
        if kind == "stop":
            return
        if kind == "begin":
            assert isinstance(payload, PushJob)
            self._admit(payload)
            return
        rid = payload[0] if isinstance(payload, tuple) else payload
        with self._jobs_lock:
            job = self._jobs.get(str(rid))
        if job is None:  # failed at once, or over: nothing kept for it
            if kind == "finished":
                self._over(str(rid))  # NOTE: no READ of its blocks is asked any more
            if kind in ("part", "unpart", "offer", "offers", "finished"):
                return
            if kind == "chunk":
                assert isinstance(payload, tuple)
                self.store.release_slots([payload[2]])
            return
        peer = self._peer(job.endpoint)
        if kind == "chunk":
            assert isinstance(payload, tuple)
            job.tail_from = payload[3]  # NOTE: when it was handed over; the last one's counts
            self._route_chunk(peer, job, payload[1], payload[2])
            return
        if kind == "offers":
            assert isinstance(payload, tuple)
            peer.events.put(("offers", [(job, *offer) for offer in payload[1]]))
            return
        if kind == "offer" and isinstance(payload, tuple) and not payload[5]:
            job.tail_from = payload[4]  # NOTE: a chunk's final offer: when it was computed
        rest = payload[1:] if isinstance(payload, tuple) else ()
        peer.events.put((kind, (job, *rest)))

    def _route_chunk(self, peer: _Peer, job: PushJob, index: int, slot: int) -> None:
        """Hand chunk ``index`` over; released at once instead if ``job``
        still waits for its Reserve and may keep no chunk (see the module
        docstring); while a receiver stalls, each chunk checks the store."""
        ref = _SlotRef(slot)
        now = time.monotonic()
        if job.settled:
            job.early = []  # NOTE: its thread takes them from here on
        else:
            job.early.append(ref)
            if job.starved or self._over_age(job, now):
                self._starve(job)
        if self._stalled or peer.stalled(now, self.stall_s):
            self._starve_stalled(self._stalled | {peer.endpoint}, now)
        peer.events.put(("chunk", (job, index, ref)))

    def _starve_stalled(self, endpoints: set[str], now: float) -> None:
        """While the store is short of slots, release the waiting pushes of
        every receiver in ``endpoints`` that still stalls."""
        with self._peers_lock:
            peers = [p for e in endpoints if (p := self._peers.get(e)) is not None]
        stalled = {p.endpoint for p in peers if p.stalled(now, self.stall_s)}
        if not stalled or not self._pressed():
            return
        with self._jobs_lock:
            jobs = [j for j in self._jobs.values() if j.endpoint in stalled and j.early]
        for job in jobs:
            if not job.settled:
                self._starve(job)

    def _over_age(self, job: PushJob, now: float) -> bool:
        """Whether ``job`` has waited ``max_unsettled_s`` for its Reserve."""
        return now - job.admitted_at > self.max_unsettled_s

    def _pressed(self) -> bool:
        """Whether the store is short of slots (see the module docstring)."""
        allocatable, total = self.store.allocatable()
        return allocatable < max(STALL_PRESSURE * total, min(MIN_FREE_SLOTS, total))

    def _starve(self, job: PushJob) -> None:
        """Release the chunks ``job`` was handed before its Reserve settled
        (the endpoint's thread fails it, finding them gone)."""
        if not job.starved:
            logger.info(
                "fabric push %s (request %s): no Reserve from %s yet (it stalls while the store "
                "is short of slots, or the push waited too long); chunks released",
                job.transfer_id,
                job.req_id,
                job.endpoint,
            )
        job.starved = True
        early, job.early = job.early, []
        slots = [slot for ref in early if (slot := ref.take()) is not None]
        if slots:
            self.store.release_slots(slots)

    def _admit(self, job: PushJob) -> None:
        """Hand ``job`` to its endpoint's thread, or fail it at once."""
        with self._jobs_lock:
            old = self._jobs.pop(job.req_id, None)
        if old is not None:
            self._peer(old.endpoint).events.put(("fail", (old, "replaced by a new push")))
        with self._peers_lock:
            known, full = job.endpoint in self._peers, len(self._peers) >= MAX_PEERS
        if not known and full:
            self._fail_at_once(job, f"pushing to {MAX_PEERS} endpoints already", quiet=False)
            return
        peer = self._peer(job.endpoint)
        if peer.backed_off(time.monotonic()):
            self._fail_at_once(job, f"{job.endpoint} failed recently", quiet=True)
        elif peer.waiting >= self.max_waiting:
            why = f"{peer.waiting} pushes to {job.endpoint} wait for their Reserve already"
            self._fail_at_once(job, why, quiet=peer.saturated)
            peer.saturated = True
        else:
            peer.saturated = False
            job.admitted_at = time.monotonic()
            with self._jobs_lock:
                self._jobs[job.req_id] = job
            peer.admitted += 1
            peer.events.put(("begin", job))

    def _fail_at_once(self, job: PushJob, why: str, *, quiet: bool) -> None:
        """Count ``job`` failed without keeping it (its chunks are released as they come)."""
        self.counters.add(**{self.names.failures: 1})
        log = logger.debug if quiet else logger.warning
        log("fabric push %s (request %s): %s; not tried", job.transfer_id, job.req_id, why)

    def _peer(self, endpoint: str) -> _Peer:
        with self._peers_lock:
            peer = self._peers.get(endpoint)
            if peer is None:
                port = endpoint.rpartition(":")[2][:8]  # NOTE: the OS keeps 15 bytes of a name
                peer = _Peer(
                    endpoint, self._serve, f"{self.name}:{endpoint}", f"{self.os_prefix}:{port}"
                )
                self._peers[endpoint] = peer
                peer.thread.start()
            return peer

    def _tend(self) -> None:
        """Stop the threads of endpoints idle for ``peer_idle_s``; replace dead ones."""
        now = time.monotonic()
        if now < self._next_tend:
            return
        self._next_tend = now + _TEND_EVERY_S
        with self._peers_lock:
            peers = list(self._peers.values())
        self._stalled = {peer.endpoint for peer in peers if peer.stalled(now, self.stall_s)}
        if self._stalled:
            self._starve_stalled(self._stalled, now)
        with self._jobs_lock:
            waiting = [j for j in self._jobs.values() if j.early]
        for job in waiting:
            if not job.settled and self._over_age(job, now):
                self._starve(job)
        for peer in peers:
            dead = not peer.thread.is_alive()
            if not dead and not peer.idle(now, self.peer_idle_s):
                continue
            with self._peers_lock:
                self._peers.pop(peer.endpoint, None)
            peer.events.put(None)
            # NOTE: here, before a new thread for the endpoint can connect; an
            # idle endpoint's thread uses its link no more.
            self.client.disconnect(peer.endpoint)
            if dead:
                self.counters.add(thread_errors=1)
                logger.error("%s: the thread of %s died", self.name, peer.endpoint)
                self._retire(peer)

    # ---------------------------------------------------------- endpoint thread
    def _serve(self, peer: _Peer) -> None:
        while not peer.stopped:
            try:
                self._round(peer)
            except Exception:  # NOTE: outside any one job; keep serving
                self.counters.add(thread_errors=1)
                logger.exception("%s: a round failed; continuing", peer.thread.name)
                time.sleep(0.01)
        self._retire(peer)

    def _retire(self, peer: _Peer) -> None:
        """The endpoint's thread ends: fail its jobs, release what is still queued."""
        for job in list(peer.jobs.values()):
            self._abandon(peer, job, "the sender stopped")
        while True:
            try:
                event = peer.events.get_nowait()
            except queue.Empty:
                break
            if event is not None and event[0] == "chunk":
                assert isinstance(event[1], tuple) and isinstance(event[1][2], _SlotRef)
                slot = event[1][2].take()
                if slot is not None:
                    self.store.release_slots([slot])

    def _round(self, peer: _Peer) -> None:
        busy = any(job.inflight or job.finals_waiting for job in peer.jobs.values())
        parts = not busy and any(job.parts_running for job in peer.jobs.values())
        # NOTE: parts are written while the forward runs on the same core: a
        # part's completion is looked at every PART_POLL_S (a new event wakes
        # the thread at once), not every 50 us, which would take the core
        # from the forward; a chunk's last write is polled closely.
        self._drain(peer, timeout=None if busy else PART_POLL_S if parts else self._idle_s(peer))
        self._progress(peer)
        self._probe(peer)
        if peer.cancelling:
            peer.cancelling = {link for link in peer.cancelling if not link.flush()}
        if busy:
            time.sleep(5e-5)
        if peer.jobs:
            peer.last_active = time.monotonic()
        if peer.ended:
            self._record_paths(peer)

    def _idle_s(self, peer: _Peer) -> float:
        """How long ``peer``'s thread waits for an event when nothing of it is
        polled (no write in flight, no part): until its next heartbeat is
        due, ``IDLE_ROUND_S`` at most (a new event wakes it at once); 50 ms
        while it sends Cancels or is backed off (probes). A push whose
        decoder reads its chunks (an Offer per chunk or layer group, each
        an event) waits so through the whole prefill, on the engine's core."""
        now = time.monotonic()
        if peer.cancelling or peer.backed_off(now):
            return 0.05
        wait = IDLE_ROUND_S
        for job in peer.jobs.values():
            if not (job.failed or job.complete or job.link is None):
                wait = min(wait, job.last_heartbeat + self.lease_ms / 3000 - now)
        return max(0.001, wait)

    def _probe(self, peer: _Peer) -> None:
        """While ``peer`` is backed off, ask it every ``PROBE_EVERY_S`` whether it
        answers; an answer ends the backoff, once per backoff level (a receiver
        whose control channel answers but whose pushes keep failing is backed
        off as before once the level stops rising). Not while pushes granted
        earlier are still served here (their polls and heartbeats come
        first), not for the shared store (its Attach comes before a Hello),
        not once the sender stops. One control call at most: a Stats on the
        link, or the Hello of a new one."""
        now = time.monotonic()
        if (
            not peer.backed_off(now)
            or now < peer.next_probe
            or peer.jobs
            or peer.stopped
            or self._stop.is_set()
            or self.prepare is not None
            or peer.probed_s == peer.backoff_s
        ):
            return
        try:
            with peer.calling():
                link = self.client.current_link(peer.endpoint)
                if link is None:
                    self.client.connect(peer.endpoint)  # NOTE: its Hello is the answer
                    answered = True
                else:
                    answered = link.ping()
        except FabricError as exc:
            logger.debug("fabric: %s still does not answer: %s", peer.endpoint, exc)
            return
        finally:
            peer.next_probe = time.monotonic() + PROBE_EVERY_S
        now = time.monotonic()
        if answered and peer.backed_off(now):
            # NOTE: not 0: calls begun during the outage stay part of it (``news``)
            peer.backoff_until, peer.probed_s = now, peer.backoff_s
            logger.warning("fabric: %s answers again; pushes to it resume", peer.endpoint)

    def _drain(self, peer: _Peer, timeout: float | None) -> None:
        try:
            event = peer.events.get(timeout=timeout) if timeout else peer.events.get_nowait()
        except queue.Empty:
            return
        while event is not None:
            peer.last_active = time.monotonic()
            if event[0] == "offer":
                offers, after = self._take_offers(peer, event)
                self._handle_guarded(peer, "offers", offers)
                if after is _NO_EVENT:
                    return
                event = after  # type: ignore[assignment]
                continue
            self._handle_guarded(peer, *event)
            try:
                event = peer.events.get_nowait()
            except queue.Empty:
                return
        peer.stopped = True

    def _take_offers(self, peer: _Peer, first: tuple[str, object]) -> tuple[list[tuple], object]:
        """The offer event ``first`` and the offers of the same push queued
        right behind it (each chunk once, ``MAX_OFFER_BATCH`` at most): one
        round trip for them all (``PeerLink.offer_many``). Returns them and
        the event after them (``_NO_EVENT``: none queued), in queue order."""
        payload = first[1]
        assert isinstance(payload, tuple)
        job = payload[0]
        offers = [payload]
        indices = {payload[1]}
        nbytes, cap = self._read_bytes(job, payload[1], payload[5]), self._batch_bytes(peer)
        while True:
            try:
                event = peer.events.get_nowait()
            except queue.Empty:
                return offers, _NO_EVENT
            nxt = event[1] if event is not None and event[0] == "offer" else None
            if not isinstance(nxt, tuple) or nxt[0] is not job or nxt[1] in indices:
                return offers, event
            more = self._read_bytes(job, nxt[1], nxt[5])
            if len(offers) >= MAX_OFFER_BATCH or nbytes + more > cap:
                return offers, event
            offers.append(nxt)
            indices.add(nxt[1])
            nbytes += more

    def _offer_batches(self, peer: _Peer, offers: list[tuple]) -> list[list[tuple]]:
        """``offers`` of one push (an ``offers`` event, or what
        :meth:`_take_offers` took, which this leaves whole) cut into batches
        of ``MAX_OFFER_BATCH`` offers and :meth:`_batch_bytes` at most each
        (a batch holds one whatever its size), in order: a round trip each."""
        cap = self._batch_bytes(peer)
        batches: list[list[tuple]] = []
        nbytes = 0
        for offer in offers:
            more = self._read_bytes(offer[0], offer[1], offer[5])
            if not batches or len(batches[-1]) >= MAX_OFFER_BATCH or nbytes + more > cap:
                batches.append([])
                nbytes = 0
            batches[-1].append(offer)
            nbytes += more
        return batches

    def _handle_guarded(self, peer: _Peer, kind: str, payload: object) -> None:
        job = payload if isinstance(payload, PushJob) else None
        if job is None and isinstance(payload, tuple) and isinstance(payload[0], PushJob):
            job = payload[0]
        if job is None and isinstance(payload, list):  # NOTE: offers of one push
            job = payload[0][0]
        # NOTE: not its Reserve (a link's first also connects): the same for either path
        cpu = time.thread_time() if job is not None and job.path and kind != "begin" else 0.0
        try:
            self._handle(peer, kind, payload)
        except Exception as exc:
            self.counters.add(thread_errors=1)
            logger.exception("%s: handling %s failed", peer.thread.name, kind)
            if job is not None and not job.dropped:
                self._abandon(peer, job, f"{type(exc).__name__}: {exc}")
        finally:
            if cpu and job is not None:
                job.link_cpu_s += time.thread_time() - cpu

    def _handle(self, peer: _Peer, kind: str, payload: object) -> None:
        if kind == "begin":
            assert isinstance(payload, PushJob)
            peer.jobs[id(payload)] = payload
            self._reserve(peer, payload)
            return
        if kind == "offers":
            assert isinstance(payload, list)
            for batch in self._offer_batches(peer, payload):
                self._offers(peer, batch[0][0], [tuple(o[1:]) for o in batch])
            return
        assert isinstance(payload, tuple) and isinstance(payload[0], PushJob)
        job = payload[0]
        if kind == "part":
            self._part(job, *payload[1:])
        elif kind == "unpart":
            # NOTE: a part in flight from the slot goes on (an abort cannot
            # promise no more bytes land); the chunk's write waits for it and
            # goes whole, so D's digest of the part fails and it verifies anew
            if (part := job.parts.get(payload[1])) is not None:
                part.void = True
        elif kind == "chunk":
            assert isinstance(payload[2], _SlotRef)
            slot = payload[2].take()
            if slot is None:  # NOTE: released by the dispatcher: the receiver stalled
                self._fail(job, f"chunk {payload[1]} released while {job.endpoint} stalled", peer)
            else:
                self._write(job, payload[1], slot)
        elif kind == "finished":
            job.finished = True
            self._maybe_drop(peer, job)
        elif kind == "fail":
            self._fail(job, payload[1], peer)
            self._maybe_drop(peer, job)

    def _abandon(self, peer: _Peer, job: PushJob, why: str) -> None:
        """Fail ``job`` and forget it, releasing every slot it still holds."""
        self._drop_parts(job)
        for entry in list(job.inflight):
            with contextlib.suppress(Exception):
                entry[1].abort()
            try:
                self._drop_inflight(job, entry)
            except Exception:
                logger.exception("%s: releasing slot %d failed", self.name, entry[0])
        job.inflight = []
        try:
            self._fail(job, why, peer)
        except Exception:
            logger.exception("%s: failing %s failed too", self.name, job.req_id)
        self._drop(peer, job)

    def _reserve(self, peer: _Peer, job: PushJob) -> None:
        try:
            if job.starved:
                self._fail(job, f"{job.endpoint} stalled; its chunks were released", peer)
                return
            if peer.backed_off(time.monotonic()):
                self._fail(job, f"{job.endpoint} failed recently", peer, quiet=True)
                return
            started = time.monotonic()
            try:
                with peer.calling():
                    if self.prepare is not None:
                        self.prepare(job.endpoint)
                    job.link = self.client.connect(job.endpoint)
                    job.asked = True
                    job.res = job.link.reserve(job.transfer_id, job.keys, job.nbytes, self.lease_ms)
                job.last_heartbeat = job.settled_at = time.monotonic()
                if self.paths is not None:
                    self.paths.set_reads(job.endpoint, job.link.peer_reads)
            except FabricError as exc:
                job.asked = job.asked and not isinstance(exc, ReservationRefused)
                self._peer_failed(peer, exc, started=started, link=job.link)
                self._fail(job, f"reserve on {job.endpoint} failed: {exc}", peer)
        finally:
            job.settled = True
            peer.settled += 1
            if job.starved:  # NOTE: the dispatcher released chunks meanwhile
                self._fail(job, f"{job.endpoint} stalled; its chunks were released", peer)
            self._maybe_drop(peer, job)

    def _peer_failed(
        self, peer: _Peer, exc: FabricError, *, started: float, link: PeerLink | None
    ) -> None:
        """Back off an endpoint that failed, once per incident (a refusal is
        an answer, not a failure; see the module docstring). ``started``:
        when the failed call began; ``link``: the link it used (None: none
        was made)."""
        if isinstance(exc, ReservationRefused | ReservationExpired) or not self.backoff_s:
            return
        if link is not None and (
            link.closed or self.client.current_link(peer.endpoint) is not link
        ):
            logger.debug("fabric: %s: a dropped link failed (%s); ignored", peer.endpoint, exc)
            return
        if not peer.news(started):
            logger.debug("fabric: %s failed again (%s) in the same incident", peer.endpoint, exc)
            return
        peer.back_off(time.monotonic(), self.backoff_s)
        logger.warning(
            "fabric: %s failed (%s); pushes to it fail at once for %.0f s",
            peer.endpoint,
            exc,
            peer.backoff_s,
        )
        if peer.backoff_s >= self.backoff_s and not any(j.inflight for j in peer.jobs.values()):
            # NOTE: dead for a while and nothing in flight to it: keep no link
            # (nor its data-plane peer); the next push says Hello again.
            self.client.disconnect(peer.endpoint, link)

    def _batch_bytes(self, peer: _Peer) -> int:
        """How many bytes one batch of offers to ``peer`` may have it read:
        what it reads at the rate it read offers lately (``UNMEASURED_RATE``
        before any was measured) in a quarter of the control timeout (each
        read is bounded by 0.8 of it, counted from when its batch came) or
        half the stall threshold, whichever is shorter;
        ``MAX_OFFER_BATCH_BYTES`` at most. A batch holds one offer whatever
        its size."""
        timeout_s = self.client.config.control_timeout_ms / 1000 if self.client is not None else 5.0
        budget_s = min(timeout_s / 4, self.stall_s / 2)
        return int(min(MAX_OFFER_BATCH_BYTES, (peer.read_bps or UNMEASURED_RATE) * budget_s))

    @staticmethod
    def _note_rate(peer: _Peer, nbytes: int, took: float) -> None:
        """Offers that had ``nbytes`` read were answered in ``took`` seconds:
        the peer's read rate (round trips in: it errs low)."""
        if nbytes >= 1 << 20 and took > 0:
            rate = nbytes / took
            peer.read_bps = rate if not peer.read_bps else (peer.read_bps + rate) / 2

    def _read_bytes(self, job: PushJob, index: int, layers: int) -> int:
        """What an offer of chunk ``index`` up to ``layers`` layers (0: all)
        has the receiver read: the layers not offered before (the whole
        chunk where the layer count is unknown)."""
        res = job.res
        if res is None or not 0 <= index < len(res.nbytes):
            return 0
        nbytes, total = int(res.nbytes[index]), self.num_layers
        if total <= 0:
            return nbytes
        return nbytes * max(0, self._upto(layers) - job.offered_layers.get(index, 0)) // total

    def _upto(self, layers: int) -> int:
        """The layers an offer of ``layers`` makes final (0, or the count: all)."""
        return layers if 0 < layers < self.num_layers else self.num_layers

    def _offered(self, job: PushJob, index: int, layers: int) -> int:
        """Chunk ``index`` was read up to ``layers`` (0: all): what that read."""
        nbytes = self._read_bytes(job, index, layers)
        job.offered_layers[index] = max(job.offered_layers.get(index, 0), self._upto(layers))
        return nbytes

    def _offers(self, peer: _Peer, job: PushJob, offers: list[tuple]) -> None:
        """Offer chunks (direct reads), or their leading ``layers`` layers
        (parts): ``offers`` of (index, block_ids, checksum, computed_at,
        layers), each chunk once, queued together (``_take_offers``) or
        handed over together (``offer_parts``) and cut to size
        (``_offer_batches``), go back to back, one round trip for them all
        (``PeerLink.offer_many``). The
        call returns once the receiver read them, so this endpoint's thread
        waits that long (bounded by the control timeout; the receiver reads
        one chunk in a few ms). The first that fails fails the push, a part
        as a chunk would.

        vLLM keeps the request's blocks until its push is over, so a chunk
        that waited ``push_timeout_s`` since it was computed (a receiver
        slow to answer this push's or other pushes' calls) fails the push
        instead: its blocks go back to vLLM (``on_over``)."""
        res = job.res
        if job.dropped or job.failed or job.link is None or res is None:
            return
        now = time.monotonic()
        asked = []
        for index, block_ids, checksum, computed_at, layers in offers:
            if now - computed_at > self.push_timeout_s:
                waited = now - computed_at
                self._fail(job, f"chunk {index} waited {waited:.0f} s to be offered", peer)
                return
            if res.already_present[index]:
                if not layers:  # NOTE: a part of a chunk the receiver has is nothing to count
                    job.written += 1
                    self._count_sent(0, 0.0)
                continue
            asked.append(ChunkOffer(index, block_ids, checksum, layers))
        if asked:
            if self.cache is None:
                raise FabricError("an offer reached a sender without a cache map")
            started = time.monotonic()
            try:
                with peer.calling():
                    job.link.offer_many(res, asked, self.cache)
            except FabricError as exc:
                self._peer_failed(peer, exc, started=started, link=job.link)
                job.path_failed = True
                if len(asked) > 1:  # NOTE: smaller batches from here on, until measured again
                    peer.read_bps = (peer.read_bps or UNMEASURED_RATE) / 2
                what = ", ".join(
                    f"{o.layers} layers of chunk {o.index}" if o.layers else f"chunk {o.index}"
                    for o in asked
                )
                self._fail(job, f"offer of {what} failed: {exc}", peer)
                return
            took = time.monotonic() - started
            self._note_rate(peer, sum(self._offered(job, o.index, o.layers) for o in asked), took)
            for o in asked:
                if o.layers:
                    self.counters.add(parts_offered=1)
                    continue
                job.written += 1
                self._count_sent(res.nbytes[o.index], took / len(asked))
                self.counters.add(chunks_offered=1)
        self._maybe_drop(peer, job)

    def _part(self, job: PushJob, index: int, slot: int, layers: int, nbytes: int) -> None:
        """Write what is packed of chunk ``index`` beyond what was written."""
        res = job.res
        if job.dropped or job.failed or job.link is None or res is None:
            return
        if res.already_present[index] or (index in job.parts and job.parts[index].slot != slot):
            return
        part = job.parts.setdefault(index, _Part(slot))
        if part.final is None and nbytes > part.want[1]:
            part.want = (layers, nbytes)
            self._post_part(job, index, part)

    def _post_part(self, job: PushJob, index: int, part: _Part) -> None:
        """Post the next part of ``index`` (or its final write) unless one runs."""
        if part.pending is not None or job.failed or job.dropped:
            return
        if part.final is not None:
            slot, part.final = part.final, None
            self._write(job, index, slot)
            return
        assert job.link is not None and job.res is not None
        if part.epoch != job.link.route_epoch:
            # NOTE: what went over a route loaded again since may not have
            # landed; the parts go again from byte 0, over bytes the decoder
            # may have read: its digest of them must not count, so the chunk's
            # last write goes whole (its WriteDone then says it began at 0)
            part.rewrote = part.rewrote or part.landed > 0
            part.landed = 0
        layers, nbytes = part.want
        if part.void or nbytes <= part.landed:
            return
        started = time.monotonic()
        try:
            push = job.link.write_part(job.res, index, part.slot, (part.landed, nbytes), layers)
        except FabricError as exc:
            self._post_failed(job, exc, started, f"write of a part of chunk {index}")
            return
        part.pending = (push, part.want, started)

    def _progress_parts(self, peer: _Peer, job: PushJob, now: float) -> None:
        for index, part in list(job.parts.items()):
            if part.pending is None:
                continue
            push, (_, nbytes), started = part.pending
            try:
                done = push.done()
            except FabricError as exc:
                part.pending = None
                self._peer_failed(peer, exc, started=started, link=job.link)
                job.path_failed = True
                self._fail(job, f"write of a part of chunk {index} failed: {exc}", peer)
                continue
            if done:
                part.pending, part.landed, part.epoch = None, nbytes, push.route_epoch
                part.rewrote = part.rewrote or push.rewrote
                # NOTE: its bytes count as sent (the chunk's last write carries
                # only the rest); a part sent again from byte 0 carried them all
                sent = nbytes if push.rewrote else push.nbytes
                self.counters.add(parts_sent=1, **{self.names.bytes: sent})
                self._post_part(job, index, part)
            elif now - started > self.push_timeout_s:
                push.abort()
                part.pending = None
                timeout = TransferTimeout(f"part write not done in {self.push_timeout_s} s")
                self._peer_failed(peer, timeout, started=started, link=job.link)
                job.path_failed = True
                self._fail(job, str(timeout), peer)
        if job.failed:
            self._drop_parts(job)

    def _drop_parts(self, job: PushJob) -> None:
        """Abort the parts in flight and release the final writes that waited for them."""
        parts, job.parts = job.parts, {}
        for part in parts.values():
            if part.pending is not None:
                with contextlib.suppress(Exception):
                    part.pending[0].abort()
            if part.final is not None:
                self.store.release_slots([part.final])

    def _write(self, job: PushJob, index: int, slot: int) -> None:
        if job.dropped or job.failed or job.link is None or job.res is None:
            self.store.release_slots([slot])
            return
        part = job.parts.get(index)
        if part is not None and part.pending is not None:
            part.final = slot  # NOTE: posted once the part in flight ended
            return
        landed, epoch = {}, -1
        if part is not None:
            del job.parts[index]
            if part.slot == slot and not part.void and not part.rewrote:
                landed, epoch = {index: part.landed}, part.epoch
        started = time.monotonic()
        try:
            push = job.link.write(job.res, [index], [slot], landed=landed, landed_epoch=epoch)
        except Exception as exc:
            self.store.release_slots([slot])  # NOTE: the one release of this slot
            if not isinstance(exc, FabricError):
                raise
            self._post_failed(job, exc, started, f"write of chunk {index}")
            return
        job.written += 1
        job.inflight.append((slot, push, time.monotonic()))

    def _post_failed(self, job: PushJob, exc: FabricError, started: float, what: str) -> None:
        """A write of ``job`` could not be posted: back its receiver off, fail the push."""
        job.path_failed = True
        with self._peers_lock:
            peer = self._peers.get(job.endpoint)
        if peer is not None:
            self._peer_failed(peer, exc, started=started, link=job.link)
        self._fail(job, f"{what} failed: {exc}", peer)

    def _progress(self, peer: _Peer) -> None:
        now = time.monotonic()
        for job in list(peer.jobs.values()):
            cpu = time.thread_time() if job.path else 0.0
            try:
                self._progress_job(peer, job, now)
            except Exception as exc:
                self.counters.add(thread_errors=1)
                logger.exception("%s: progressing %s failed", self.name, job.req_id)
                self._abandon(peer, job, f"{type(exc).__name__}: {exc}")
            finally:
                if cpu:
                    job.link_cpu_s += time.thread_time() - cpu

    def _progress_job(self, peer: _Peer, job: PushJob, now: float) -> None:
        if job.parts:
            self._progress_parts(peer, job, now)
        for entry in list(job.inflight):
            _, push, started = entry
            try:
                done = push.done()
            except FabricError as exc:
                self._drop_inflight(job, entry)
                self._peer_failed(peer, exc, started=started, link=job.link)
                job.path_failed = True
                self._fail(job, f"write failed: {exc}", peer)
                continue
            if done:
                self._drop_inflight(job, entry)
                self._count_sent(push.nbytes, now - started)
            elif now - started > self.push_timeout_s:
                push.abort()  # NOTE: no more bytes from it; the receiver quarantines the rest
                self._drop_inflight(job, entry)
                timeout = TransferTimeout(f"write not done in {self.push_timeout_s} s")
                self._peer_failed(peer, timeout, started=started, link=job.link)
                job.path_failed = True
                self._fail(job, str(timeout), peer)
        if job.complete and not job.failed:
            peer.backoff_s = peer.backoff_until = 0.0  # NOTE: a push landed: the peer serves
        self._heartbeat(peer, job, now)
        self._maybe_drop(peer, job)

    def _drop_inflight(self, job: PushJob, entry: tuple[int, PendingPush, float]) -> None:
        """Forget one posted write and release its slot: once, whatever raises."""
        job.inflight.remove(entry)
        self.store.release_slots([entry[0]])

    def _count_sent(self, nbytes: int, seconds: float) -> None:
        names = self.names
        if nbytes or names.count_present:
            self.counters.add(**{names.sent: 1, names.bytes: nbytes})
        if names.write_seconds is not None:
            self.counters.observe(names.write_seconds, seconds)

    def _heartbeat(self, peer: _Peer, job: PushJob, now: float) -> None:
        # NOTE: a long prefill (tens of seconds on a CPU) must not let the
        # decoder's reservation expire while chunks are still to come.
        if job.failed or job.complete or job.link is None:
            return
        if now - job.last_heartbeat > self.lease_ms / 3000:
            job.last_heartbeat = now
            try:
                with peer.calling():
                    held = job.link.heartbeat(job.transfer_id, self.lease_ms)
            except FabricError as exc:
                self._peer_failed(peer, exc, started=now, link=job.link)
                self._fail(job, f"heartbeat failed: {exc}", peer)
                return
            if not held:
                self._fail(job, "the receiver no longer holds the reservation", peer)

    def _maybe_drop(self, peer: _Peer, job: PushJob) -> None:
        if job.failed and job.parts:
            self._drop_parts(job)
        if job.inflight or job.dropped or job.parts_running:
            return
        if job.complete or job.failed:
            self._drop(peer, job)
        elif job.finished:
            self._fail(job, "request finished before every chunk was computed", peer)
            self._drop(peer, job)

    def _drop(self, peer: _Peer, job: PushJob) -> None:
        """Forget ``job`` everywhere: its endpoint's jobs, the routing table, its lease."""
        if job.dropped:
            return
        job.dropped = True
        job.ended_at = time.monotonic()
        if job.path and self.paths is not None:
            peer.ended.append(job)  # NOTE: recorded at the round's end, its CPU all added
        peer.jobs.pop(id(job), None)
        with self._jobs_lock:
            if self._jobs.get(job.req_id) is job:
                del self._jobs[job.req_id]
            replaced = job.req_id in self._jobs  # NOTE: a new push of the request goes on
        if job.link is not None:
            job.link.forget(job.transfer_id)
        peer.dropped += 1
        if not replaced:
            self._over(job.req_id)
        tail = self.names.tail_seconds
        if tail is not None and job.complete and not job.failed and job.tail_s > 0:
            self.counters.observe(tail, job.tail_s)  # NOTE: after the hold went back

    def _record_paths(self, peer: _Peer) -> None:
        """What the pushes that ended on ``peer`` cost their paths (direct_reads
        auto): their CPU, the bytes they moved (not those the receiver had),
        their tails; a failed one counts as its path's failure. After their
        holds were given back (``_over``): an error here keeps nothing."""
        ended, peer.ended = peer.ended, []
        assert self.paths is not None
        for job in ended:
            try:
                res = job.res
                moved = 0
                if res is not None:
                    had = res.already_present
                    moved = sum(n for n, h in zip(job.nbytes, had, strict=False) if not h)
                ok = job.complete and not job.failed and res is not None
                cpu = job.pack_cpu_s + job.link_cpu_s
                self.paths.record(
                    job.endpoint, job.path, cpu, moved, job.tail_s, ok, failed=job.path_failed
                )
            except Exception:
                self.counters.add(thread_errors=1)
                logger.exception("%s: recording the path of %s failed", self.name, job.req_id)

    def _over(self, req_id: str) -> None:
        """The push of ``req_id`` is over (or there is none): no read of its
        blocks is asked from here on (``on_over``; called again harmlessly)."""
        if self.on_over is not None:
            try:
                self.on_over(req_id)
            except Exception:
                self.counters.add(thread_errors=1)
                logger.exception("%s: on_over(%s) failed", self.name, req_id)

    def _fail(
        self, job: PushJob, why: str, peer: _Peer | None = None, *, quiet: bool = False
    ) -> None:
        """Count ``job`` failed and cancel its reservation (if it may have
        one) without waiting: ``peer``'s thread sends what the socket did
        not take at once."""
        if job.failed:
            return
        job.failed = True
        self.counters.add(**{self.names.failures: 1})
        log = logger.debug if quiet else logger.warning
        log("fabric push %s (request %s): %s", job.transfer_id, job.req_id, why)
        link = job.link
        if link is None or not (job.res is not None or job.asked) or link.closed:
            return
        # NOTE: the decoder learns of the failure now rather than after its
        # load timeout; a Cancel that never goes only delays that fallback.
        link.cancel_later(job.transfer_id, self.lease_ms / 1000)
        if link.num_cancels and peer is not None:
            peer.cancelling.add(link)
