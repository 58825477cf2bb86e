"""The scheduler's line to its workers' reuse tiers and the host's shared store.

These calls run inside vLLM's ``get_num_new_matched_tokens``, on the
engine's scheduler thread: while they wait, nothing is scheduled. So no
call waits for its answer across a step: a request's lookup is sent on its
first ask and answered over as many steps as it takes::

    step 1  ask(r1, wait_s)  Lookup(hold=r1) to every rank, wait <= wait_s
                             (the step's wait, ``lookup_timeout_ms``)
            -> None          not every rank answered: vLLM skips r1 this
                             step and asks again in the next one
    step 2  ask(r1)          takes the answers that came, no wait -> None
    step 3  ask(r1)          every rank answered -> the smallest hit
            ...              or ``lookup_deadline_ms`` after the first ask
                             passed: a miss (``lookup_timeouts``)

vLLM's contract for this (``vllm/distributed/kv_transfer/kv_connector/v1/
base.py:501-531``): ``get_num_new_matched_tokens`` returning ``None``
means "the connector needs more time to determine the number of matched
tokens, and the scheduler should query for this request again later". The
scheduler then skips the request (``vllm/v1/core/sched/scheduler.py:986-991``,
``skip_request`` :904) and goes on with the requests behind it; once the
step's scan ends it puts the skipped ones back at the head of the waiting
queue (:1391-1395; a priority queue re-inserts them by priority), so a
skipped request keeps its place, and nothing in vLLM times it out (it
counts as ``num_skipped_waiting_reqs``, :2944). A step that runs nothing
still calls the hooks, then sleeps 1 ms (``vllm/v1/engine/core.py:1616``),
so a lone waiting request is asked about once a millisecond. A request
whose sampling or pooling parameters skip the prefix cache gets 0 whatever
the connector says (scheduler.py:983): fabric does not look those up.

The store lives in the worker process(es); the scheduler asks each TP
rank's control endpoint (``host:kv_port + rank``, or, with ``kv_port`` 0,
the endpoint the worker wrote to a file named after the engine id) how many
leading full chunks of a prompt it holds, holding them for the request. All
ranks are asked at once; the smallest hit wins: a rank that holds less
limits what every rank can load. Answers are matched to their request by
sequence number (:meth:`~fabric.transfer.store_client.StoreClient.post`).
Where the worker lives in the scheduler's process (TP 1 on a GPU) and
keeps no disk tier, a lookup is answered on the scheduler's thread at its
first ask (:meth:`WorkerTierClient._ask_here`): nothing above applies to
it. Whether a first ask waits at all is :class:`WaitGauge`'s call: not
while recent answers did not come within their wait.

What a failure costs (:class:`Backoff`):

* A rank that has not answered by the deadline is a miss for that request
  only: vLLM computes the prompt and the miss is counted
  (``lookup_timeouts``). A rank slower than the step's wait but within the
  deadline costs the request a few steps (``lookups_deferred``), nothing
  else.
* ``MAX_TIMEOUTS`` requests in a row past the deadline, or one hard failure
  (no connection took the request by the deadline: nothing listens; a
  refusal; a secret mismatch; no endpoint known yet), and the tier is not
  asked for ``BACKOFF_S``; the log says why (``Backoff.reason``),
  ``lookup_backoffs`` counts it. The clients are dropped with it, so
  requests still queued for a stalled rank die with their sockets. After
  that one request probes the tier again (others miss until it is
  answered): an answer resumes the tier, anything else backs off again.
* At most ``MAX_IN_FLIGHT`` lookups per rank are unanswered at a time: a
  stalled rank gets no more, so stale lookups do not pile up there to all
  run, taking holds, when it resumes. A request that could not be sent by
  its deadline is a late answer, not a hard failure. A rank that refuses a
  lookup as busy (its queue was full, nothing was done) is asked again in
  a later step, until the deadline.

Holds no one uses: a request that ends while its lookup is in flight is
released at once (a lookup the worker is running then keeps nothing, see
:mod:`fabric.store.tier`), and the lookup is still watched for its answer
until its lease could end, as is one past its deadline: one that ran after
that release, and says a rank holds chunks for the request, is released
again (:meth:`WorkerTierClient.poll`, once per step, shipped as a
``release`` in the next step's metadata). A lookup whose socket went with a
backoff cannot be watched: what it held ends with its lease.

:class:`SharedTierClient` asks the host's shared store, on the same terms,
to fetch a prompt into this engine's store (rank 0's endpoint).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fabric.errors import FabricError, ProtocolError, TransferError
from fabric.integrations.vllm.config import ConnectorConfig, endpoint_file
from fabric.integrations.vllm.counters import FabricCounters
from fabric.kv.identity import BASE, KeyIdentity
from fabric.transfer import protocol as proto
from fabric.transfer.addresses import local_host
from fabric.transfer.store_client import (
    NoConnection,
    PeerBusy,
    ReplyTimeout,
    StoreClient,
    refusal_error,
    resolve_endpoint,
    wait_ready,
)
from fabric.transfer.tier_requests import in_process

logger = logging.getLogger(__name__)

BACKOFF_S = 10.0
# NOTE: one late answer is load, not a dead peer; this many in a row is.
MAX_TIMEOUTS = 3
# NOTE: per rank; a healthy rank answers each lookup within the step that
# sent it, so only a slow or stalled one ever has more than one in flight.
MAX_IN_FLIGHT = 4

# NOTE: when a first ask waits for its answer (WaitGauge)
GAUGE_WINDOW = 16  # the last first asks that waited, remembered
GAUGE_MIN_ANSWERED = 0.5  # below this share of them answered within their wait, stop waiting
GAUGE_MAX_LATE = 2  # ... or when more of them than this came back OVERRUN_S late
GAUGE_PROBE_EVERY = 8  # ... but one first ask in this many still waits (a probe)
OVERRUN_S = 0.005  # late: this far past the wait (counted as scheduler_wait_overruns too)

Result = proto.Message | FabricError
_NOT_CONNECTED = "no connection took it"
_BUSY = "it was busy"


class Backoff:
    """When to stop asking a peer for a while, and why.

    ``failed`` skips the peer for ``backoff_s`` at once; ``timed_out`` only
    once ``max_timeouts`` calls in a row got no answer in time (the count
    is reset by an answer, not by the backoff: the probe after a backoff
    that times out again backs off again at once). ``suspect`` from a
    failure until the next answer: while it is, one call (the probe) at a
    time.
    """

    def __init__(
        self,
        what: str,
        counters: FabricCounters,
        *,
        backoff_s: float = BACKOFF_S,
        max_timeouts: int = MAX_TIMEOUTS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.what, self.counters = what, counters
        self.backoff_s, self.max_timeouts, self._clock = backoff_s, max_timeouts, clock
        self.reason = ""  # why the peer was last skipped
        self.suspect = False
        self._until = 0.0
        self._timeouts = 0

    def skipping(self) -> bool:
        return self._clock() < self._until

    def answered(self) -> None:
        self._timeouts = 0
        self.suspect = False

    def timed_out(self, exc: FabricError, missed: int = 1) -> None:
        """A call (``missed`` answers of it) came too late: a miss for its request."""
        self.counters.add(lookup_timeouts=missed)
        self._timeouts += 1
        if self._timeouts >= self.max_timeouts:
            self.failed(f"{self._timeouts} calls in a row without an answer in time ({exc})")
        else:
            logger.debug(
                "fabric: %s answered too late (%s); a miss for this request", self.what, exc
            )

    def failed(self, reason: str) -> None:
        self.reason = reason
        self.suspect = True
        self._until = self._clock() + self.backoff_s
        self.counters.add(lookup_backoffs=1)
        logger.warning(
            "fabric: %s: %s; computing prompts without it for %.0f s",
            self.what,
            reason,
            self.backoff_s,
        )


# ---------------------------------------------------------------- in flight
class WaitGauge:
    """Whether a request's first ask should wait (up to the step's wait) for
    its answer.

    A wait pays when the answer comes within it and the scheduler thread
    is back when it ends. On a machine whose cores are all busy, the peer
    (another process: vLLM's multiproc executor) and then the scheduler
    thread each wait to be run: the answer often misses a 2 ms wait, and a
    thread that slept may get a core back only tens or hundreds of
    milliseconds later, while every running request waits for the step (a
    request not answered now is answered in a later step either way). So
    when, of the last ``GAUGE_WINDOW`` first asks that waited, fewer than
    ``GAUGE_MIN_ANSWERED`` were answered within their wait or more than
    ``GAUGE_MAX_LATE`` came back ``OVERRUN_S`` past it, first asks do not
    wait (``lookup_waits_skipped``), except one in ``GAUGE_PROBE_EVERY``,
    which waits to see whether waits pay again: one answered in time and
    back on time resumes waiting at once. It starts out waiting.
    """

    def __init__(self) -> None:
        self._recent: deque[tuple[bool, bool]] = deque(maxlen=GAUGE_WINDOW)  # (answered, late)
        self._skipped = 0

    def pays(self) -> bool:
        if len(self._recent) < GAUGE_WINDOW:
            return True
        answered = sum(a for a, _ in self._recent)
        late = sum(late for _, late in self._recent)
        return answered >= GAUGE_MIN_ANSWERED * GAUGE_WINDOW and late <= GAUGE_MAX_LATE

    def wait_s(self, wait_s: float) -> float:
        """What a first ask offered ``wait_s`` waits."""
        if wait_s <= 0 or self.pays():
            return wait_s
        self._skipped += 1
        if self._skipped >= GAUGE_PROBE_EVERY:
            self._skipped = 0
            return wait_s
        return 0.0

    def record(self, answered: bool, late: bool) -> None:
        """A first ask that waited: answered within its wait or not; back
        ``OVERRUN_S`` past it or not."""
        if answered and not late and not self.pays():
            self._recent.clear()  # NOTE: a probe that paid: wait again
        self._recent.append((answered, late))


@dataclass
class _Call:
    """One request to one peer."""

    client: StoreClient
    msg: proto.Message
    seq: int
    sent: bool = False
    unsent: str = ""  # why it was not sent yet
    result: Result | None = None


class _Ask:
    """One request's call on each of its peers, answered across steps."""

    def __init__(
        self, key: str, calls: list[_Call], started: float, deadline: float, lease_end: float
    ) -> None:
        self.key, self.calls, self.started = key, calls, started
        self.deadline, self.lease_end = deadline, lease_end
        self.waited = False  # NOTE: it polled for an answer (something was in flight)

    def advance(self, max_in_flight: int) -> None:
        """Send what can be sent now, take the answers that came (no wait)."""
        for call in self.calls:
            if call.result is not None:
                continue
            if call.sent:
                call.result = call.client.take_reply(call.seq)
                if isinstance(call.result, PeerBusy):  # NOTE: nothing done: ask again
                    call.sent, call.unsent, call.result = False, _BUSY, None
                continue
            if call.client.in_flight() >= max_in_flight:
                call.unsent = f"{max_in_flight} earlier requests to it still unanswered"
                continue
            try:
                call.sent = call.client.post(call.msg)
            except (ProtocolError, TransferError) as exc:
                call.result = exc
                continue
            call.unsent = "" if call.sent else _NOT_CONNECTED

    def settled(self) -> bool:
        """Every peer answered, or one failed (the others do not matter then)."""
        results = [call.result for call in self.calls]
        return all(r is not None for r in results) or any(
            isinstance(r, FabricError) for r in results
        )

    def outcome(self, deadline_ms: int) -> list[Result]:
        """Per peer, its answer or why it has none."""
        return [c.result if c.result is not None else _missing(c, deadline_ms) for c in self.calls]

    def unanswered(self) -> list[_Call]:
        return [call for call in self.calls if call.sent and call.result is None]


def _missing(call: _Call, deadline_ms: int) -> FabricError:
    endpoint, kind = call.client.endpoint, type(call.msg).__name__
    if call.sent:
        return ReplyTimeout(f"{endpoint}: no answer to {kind} in {deadline_ms} ms")
    if call.unsent == _NOT_CONNECTED:
        return NoConnection(
            f"{endpoint}: no connection took {kind} in {deadline_ms} ms "
            "(nothing listening there, or the peer stopped reading)"
        )
    return ReplyTimeout(f"{endpoint}: {kind} not sent in {deadline_ms} ms ({call.unsent})")


class _InFlight:
    """The asks in flight, by key (a request or transfer id); asks given up
    on are watched for their late answers until their lease ends."""

    def __init__(self, config: ConnectorConfig, clock: Callable[[], float]) -> None:
        self.deadline_ms, self.lease_ms = config.lookup_deadline_ms, config.lease_ms
        self.step_wait_s = config.lookup_timeout_ms / 1000
        self._clock = clock
        self.pending: dict[str, _Ask] = {}
        self.abandoned: list[_Ask] = []
        self.gauge = WaitGauge()

    def start(
        self, key: str, calls: Sequence[tuple[StoreClient, proto.Lookup | proto.Fetch]]
    ) -> _Ask:
        assert key not in self.pending, f"{key} already asked"
        now = self._clock()
        ask = _Ask(
            key,
            [_Call(client, msg, msg.seq) for client, msg in calls],
            now,
            now + self.deadline_ms / 1000,
            now + self.lease_ms / 1000,
        )
        self.pending[key] = ask
        return ask

    def progress(self, ask: _Ask, wait_s: float) -> list[Result] | None:
        """Send, take answers, and wait at most ``wait_s`` for the rest;
        the ask's outcome once it is settled or past its deadline, else None."""
        end = time.monotonic() + wait_s
        while True:
            ask.advance(MAX_IN_FLIGHT)
            if ask.settled() or self._clock() >= ask.deadline:
                break
            left = end - time.monotonic()
            waiting = [c for c in ask.calls if c.result is None]
            receiving = [c.client for c in waiting if c.sent]
            # NOTE: a call held back behind earlier ones cannot go before
            # they are taken (next step): nothing to wait for here.
            sending = [c.client for c in waiting if c.unsent == _NOT_CONNECTED]
            if left <= 0 or not (receiving or sending):
                return None
            ask.waited = True
            wait_ready(receiving, left * 1000, sending)
        del self.pending[ask.key]
        self._watch(ask)
        return ask.outcome(self.deadline_ms)

    def first(self, ask: _Ask, wait_s: float, counters: FabricCounters) -> list[Result] | None:
        """:meth:`progress` for an ask just started: it waits what the gauge
        says (at most ``wait_s``); one not answered is ``lookups_deferred``.

        A wait past the step's (a tool's :meth:`WorkerTierClient.lookup`) is
        not the gauge's to cut. The gauge learns only from asks that polled
        for their answer with at least half the step's wait: not from one
        held back behind calls in flight, nor from one the step's earlier
        asks left a sliver of the wait."""
        wait = wait_s if wait_s > self.step_wait_s else self.gauge.wait_s(wait_s)
        if wait < wait_s:
            counters.add(lookup_waits_skipped=1)
        start = time.perf_counter()
        results = self.progress(ask, wait)
        if ask.waited and self.step_wait_s / 2 <= wait <= self.step_wait_s:
            self.gauge.record(results is not None, time.perf_counter() - start > wait + OVERRUN_S)
        if results is None:
            counters.add(lookups_deferred=1)
        return results

    def pump(self) -> list[tuple[str, Result]]:
        """Once per step: advance every ask in flight (oldest first, so held-back
        calls go out as earlier answers are taken) and read the late answers
        of asks given up on (key, answer); an ask given up on is forgotten
        once answered or past its lease (any hold it took has ended)."""
        for ask in self.pending.values():
            ask.advance(MAX_IN_FLIGHT)
        late, watching, now = [], [], self._clock()
        for ask in self.abandoned:
            for call in ask.unanswered():
                call.result = call.client.take_reply(call.seq)
                if call.result is not None:
                    late.append((ask.key, call.result))
            if not ask.unanswered():
                continue
            if now < ask.lease_end:
                watching.append(ask)
            else:
                for call in ask.unanswered():
                    call.client.forget(call.seq)
        self.abandoned = watching
        return late

    def abandon(self, key: str) -> bool:
        """Give up on ``key``'s ask; whether some peer got it (may hold for it)."""
        ask = self.pending.pop(key, None)
        if ask is None:
            return False
        self._watch(ask)
        return any(call.sent for call in ask.calls)

    def drop(self) -> None:
        """Forget everything (the clients are closed with it)."""
        self.pending.clear()
        self.abandoned.clear()

    def _watch(self, ask: _Ask) -> None:
        if ask.unanswered():
            self.abandoned.append(ask)


# ---------------------------------------------------------------- reuse tier
class WorkerTierClient:
    """``TierClient`` over the control channel of every TP rank (min hit wins)."""

    def __init__(
        self,
        config: ConnectorConfig,
        *,
        tp_size: int,
        engine_id: str | None,
        counters: FabricCounters | None = None,
        backoff_s: float = BACKOFF_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config, self.tp_size, self.engine_id = config, tp_size, engine_id
        self.counters = counters if counters is not None else FabricCounters()
        self.backoff = Backoff("the reuse tier", self.counters, backoff_s=backoff_s, clock=clock)
        self._asks = _InFlight(config, clock)
        self._clients: list[StoreClient] | None = None

    def ask(
        self,
        request_id: str,
        token_ids: list[int],
        identity: KeyIdentity = BASE,
        wait_s: float = 0.0,
    ) -> int | None:
        """Leading full chunks of ``token_ids`` every rank holds, now held for
        the request (0: a miss, or the tier cannot be asked); None while some
        rank has not answered: ask again (a later step). The first ask sends
        and waits at most ``wait_s``; later asks take what came, no wait."""
        ask = self._asks.pending.get(request_id)
        if ask is None:
            here = self._ask_here(request_id, token_ids, identity)
            if here is not None:
                return here
            ask = self._start(request_id, token_ids, identity)
            if ask is None:
                return 0
            results = self._asks.first(ask, wait_s, self.counters)
        else:
            results = self._asks.progress(ask, 0.0)
        return None if results is None else self._hit(results)

    def lookup(self, request_id: str, token_ids: list[int], identity: KeyIdentity = BASE) -> int:
        """:meth:`ask`, waiting for every rank's answer (at most the deadline):
        for tools and tests; the scheduler never waits this long."""
        chunks = self.ask(request_id, token_ids, identity, self.config.lookup_deadline_ms / 1000)
        while chunks is None:  # NOTE: held back behind earlier lookups in flight
            time.sleep(0.001)
            self.poll()
            chunks = self.ask(request_id, token_ids, identity)
        return chunks

    def asked_at(self, request_id: str) -> float | None:
        """When the request's lookup in flight was started; None: none is."""
        ask = self._asks.pending.get(request_id)
        return None if ask is None else ask.started

    def cancel(self, request_id: str) -> bool:
        """The request no longer waits for its lookup (it ended, or vLLM went
        on without it); True when a rank got it, so may hold for it: release
        the request. Its late answers show in :meth:`poll`."""
        return self._asks.abandon(request_id)

    def poll(self) -> list[str]:
        """Once per step, no wait: send the lookups held back, take the answers
        that came; the requests whose given-up lookups were answered with a
        hold since the last call (release them unless they use a newer one)."""
        late = self._asks.pump()
        held = [key for key, r in late if isinstance(r, proto.LookupResult) and r.held]
        return list(dict.fromkeys(held))

    def waiting_on(self, request_id: str) -> list[str]:
        """The endpoints whose answers ``request_id``'s lookup still awaits."""
        ask = self._asks.pending.get(request_id)
        return [c.client.endpoint for c in ask.calls if c.result is None] if ask else []

    def table_sizes(self) -> dict[str, int]:
        """Lookups in flight, and given up on but watched for a late hold
        (at most ``MAX_IN_FLIGHT`` per rank)."""
        return {
            "scheduler_lookups": len(self._asks.pending),
            "scheduler_lookups_abandoned": len(self._asks.abandoned),
        }

    def _lookup(
        self, client: StoreClient, request_id: str, token_ids: list[int], identity: KeyIdentity
    ) -> proto.Lookup:
        """The request's Lookup for one rank, holding what it finds."""
        lease = self.config.lease_ms
        return client.lookup_message(token_ids, hold=request_id, lease_ms=lease, identity=identity)

    def _ask_here(self, request_id: str, token_ids: list[int], identity: KeyIdentity) -> int | None:
        """The hit, asked on this thread, when every rank's server lives in
        this process and keeps no disk tier; None: ask over the sockets.

        At TP 1 vLLM runs the worker in the engine-core process, the
        scheduler's (the ``uni`` executor: ``vllm/config/parallel.py:1079-1080``),
        so the lookup is a call: no socket, no wait, and neither thread
        waits to be woken on a busy machine. vLLM's CPU build does not (with
        ``VLLM_ENABLE_V1_MULTIPROCESSING`` on, its default, it turns ``uni``
        into ``mp``: ``vllm/platforms/cpu.py:334-341``), and its workers
        answer over the socket. With a disk tier a lookup's hold may read
        chunks in, so it goes over the socket to run off this thread. The
        call is not bounded by the step's wait: it hashes the prompt's chunk
        keys and looks them up in memory (microseconds per chunk), work the
        worker's thread would do otherwise."""
        if self.backoff.skipping() or (self.backoff.suspect and self._asks.pending):
            return None
        clients = self._connect()
        servers = [in_process(c.endpoint) for c in clients]
        if not clients or not all(server and server.answers_lookups_here() for server in servers):
            return None
        results: list[Result] = []
        for server, client in zip(servers, clients, strict=True):
            assert server is not None
            reply = server.answer_here(self._lookup(client, request_id, token_ids, identity))
            results.append(
                refusal_error(reply, client.endpoint) if isinstance(reply, proto.Refused) else reply
            )
        return self._hit(results)

    def _start(self, request_id: str, token_ids: list[int], identity: KeyIdentity) -> _Ask | None:
        if self.backoff.skipping() or (self.backoff.suspect and self._asks.pending):
            return None  # NOTE: backing off, or the probe after a backoff is in flight
        clients = self._connect()
        if not clients:
            return None
        calls = [(c, self._lookup(c, request_id, token_ids, identity)) for c in clients]
        return self._asks.start(request_id, calls)

    def _hit(self, results: list[Result]) -> int:
        """The hit every rank holds; counts and backs off on what went wrong."""
        late = [r for r in results if isinstance(r, ReplyTimeout)]
        failed = [
            r for r in results if isinstance(r, FabricError) and not isinstance(r, ReplyTimeout)
        ]
        hits = [r for r in results if isinstance(r, proto.LookupResult)]
        if not failed and len(hits) + len(late) < len(results):
            failed = [ProtocolError(f"expected LookupResult, got {results}")]
        if failed:
            self.backoff.failed(f"store lookup failed ({failed[0]})")
            self._drop_clients()  # NOTE: endpoints are resolved again after the backoff
            return 0
        if late:
            self.backoff.timed_out(late[0], len(late))
            if self.backoff.skipping():
                self._drop_clients()  # NOTE: what is queued for a stalled rank dies with it
            return 0
        self.backoff.answered()
        return min(r.hit_chunks for r in hits)

    def close(self) -> None:
        self._drop_clients()

    def endpoint(self) -> str | None:
        """Rank 0's control endpoint (where a shared store pushes fetched chunks)."""
        if self._clients:
            return self._clients[0].endpoint
        endpoints = self._endpoints()
        return endpoints[0] if endpoints else None

    def _drop_clients(self) -> None:
        self._asks.drop()
        for client in self._clients or []:
            client.close()
        self._clients = None

    def _connect(self) -> list[StoreClient]:
        if self._clients is None:
            endpoints = self._endpoints()
            if endpoints is None:
                self.backoff.failed(
                    f"no kv_port and no endpoint file from the workers of engine "
                    f"{self.engine_id} yet"
                )
                return []
            timeout = self.config.lookup_deadline_ms
            secret = self.config.resolved_secret()
            self._clients = [StoreClient(e, timeout_ms=timeout, secret=secret) for e in endpoints]
        return self._clients

    def _endpoints(self) -> list[str] | None:
        c = self.config
        if c.kv_port:
            host = local_host(c.host)  # NOTE: this host's own workers
            return [f"tcp://{host}:{c.kv_port + rank}" for rank in range(self.tp_size)]
        if self.engine_id is None:
            return None
        endpoints = []
        for rank in range(self.tp_size):
            endpoint = resolve_endpoint(str(endpoint_file(self.engine_id, rank)))
            if endpoint is None:
                return None
            endpoints.append(endpoint)
        return endpoints


# ---------------------------------------------------------------- shared store
class SharedTierClient:
    """``SharedTier`` over the shared store's control channel.

    A fetch is asked like a lookup: sent on the request's first ask, answered
    across steps, a miss past ``lookup_deadline_ms`` (``lookup_timeouts``).
    A hard failure (no connection, a refusal, no endpoint yet) is counted
    (``shared_store_failures``) and, like ``MAX_TIMEOUTS`` late answers in a
    row, skips the shared store for ``BACKOFF_S`` (:class:`Backoff`). A
    fetch given up on may still be pushed: its chunks land in this engine's
    store like any pushed chunk, and the next lookup finds them.
    """

    def __init__(
        self,
        config: ConnectorConfig,
        worker: WorkerTierClient,
        counters: FabricCounters,
        *,
        backoff_s: float = BACKOFF_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config, self.worker, self.counters = config, worker, counters
        self.backoff = Backoff("the shared store", counters, backoff_s=backoff_s, clock=clock)
        self._asks = _InFlight(config, clock)
        self._client: StoreClient | None = None

    def ask(
        self,
        transfer_id: str,
        token_ids: list[int],
        min_chunks: int,
        identity: KeyIdentity = BASE,
        wait_s: float = 0.0,
    ) -> int | None:
        """Leading full chunks of ``token_ids`` the shared store now pushes
        into this engine as ``transfer_id`` (0: none, it holds at most
        ``min_chunks``, or it cannot be asked); None while it has not
        answered: ask again. The first ask waits at most ``wait_s``."""
        ask = self._asks.pending.get(transfer_id)
        if ask is None:
            ask = self._start(transfer_id, token_ids, min_chunks, identity)
            if ask is None:
                return 0
            results = self._asks.first(ask, wait_s, self.counters)
        else:
            results = self._asks.progress(ask, 0.0)
        return None if results is None else self._fetched(results[0])

    def fetch(
        self,
        transfer_id: str,
        token_ids: list[int],
        min_chunks: int,
        identity: KeyIdentity = BASE,
    ) -> int:
        """:meth:`ask`, waiting for the answer (at most the deadline): for
        tools and tests."""
        wait_s = self.config.lookup_deadline_ms / 1000
        chunks = self.ask(transfer_id, token_ids, min_chunks, identity, wait_s)
        while chunks is None:  # NOTE: held back behind earlier fetches in flight
            time.sleep(0.001)
            self.poll()
            chunks = self.ask(transfer_id, token_ids, min_chunks, identity)
        return chunks

    def cancel(self, transfer_id: str) -> None:
        """Give up on a fetch (its request ended or no longer needs it)."""
        self._asks.abandon(transfer_id)

    def poll(self) -> None:
        """Once per step, no wait: take what came (late answers to fetches
        given up on, too)."""
        for transfer_id, result in self._asks.pump():
            if isinstance(result, proto.Fetching) and result.pushing:
                logger.debug(
                    "fabric: the shared store pushes %d chunks as %s after the fetch was "
                    "given up; they land in this engine's store",
                    result.hit_chunks,
                    transfer_id,
                )

    def table_sizes(self) -> dict[str, int]:
        return {
            "scheduler_fetches": len(self._asks.pending),
            "scheduler_fetches_abandoned": len(self._asks.abandoned),
        }

    def close(self) -> None:
        self._asks.drop()
        if self._client is not None:
            self._client.close()
            self._client = None

    def _start(
        self, transfer_id: str, token_ids: list[int], min_chunks: int, identity: KeyIdentity
    ) -> _Ask | None:
        if self.backoff.skipping() or (self.backoff.suspect and self._asks.pending):
            return None
        try:
            client, own = self._connect()
        except FabricError as exc:
            self._failed(exc)
            return None
        msg = client.fetch_message(
            transfer_id,
            token_ids,
            own,
            min_chunks=min_chunks,
            lease_ms=self.config.lease_ms,
            identity=identity,
        )
        return self._asks.start(transfer_id, [(client, msg)])

    def _fetched(self, result: Result) -> int:
        if isinstance(result, ReplyTimeout):
            self.backoff.timed_out(result)
            if self.backoff.skipping():
                self.close()
            return 0
        if not isinstance(result, proto.Fetching):
            kind = type(result).__name__
            self._failed(
                result
                if isinstance(result, FabricError)
                else ProtocolError(f"expected Fetching, got {kind}")
            )
            return 0
        self.backoff.answered()
        return result.hit_chunks if result.pushing else 0

    def _failed(self, exc: FabricError) -> None:
        self.counters.add(shared_store_failures=1)
        self.backoff.failed(f"fetch failed ({exc})")
        self.close()

    def _connect(self) -> tuple[StoreClient, str]:
        own = self.worker.endpoint()
        endpoint = self.config.shared_store_endpoint()
        if own is None or endpoint is None:
            missing = "this engine's worker endpoint" if own is None else "its endpoint file"
            raise TransferError(f"shared store {self.config.shared_store}: {missing} not known yet")
        if self._client is None or self._client.endpoint != endpoint:
            self.close()
            self._client = StoreClient(
                endpoint,
                timeout_ms=self.config.lookup_deadline_ms,
                secret=self.config.resolved_secret(),
            )
        return self._client, own
