"""Client of an engine's reuse tier over its control channel.

The engine's own scheduler asks its workers (which own the store) before it
computes a prompt; the proxy asks every engine for cache-aware routing and
its admin endpoints. No Hello and no data plane: one DEALER socket per
endpoint, one call at a time per client, every call bounded by
``timeout_ms``::

    client = StoreClient("tcp://127.0.0.1:5600")
    result = client.lookup(token_ids)             # proto.LookupResult
    result.hit_chunks * result.chunk_tokens       # prefix tokens held
    client.lookup(token_ids, hold="req-1")        # and keep them for req-1
    client.release("req-1"); client.clear("memory"); client.pin(token_ids)

    # every TP rank at once, one deadline for all:
    results = lookup_all(clients, token_ids, hold="req-1", timeout_ms=50)

A shared store (:mod:`fabric.shared_store.service`) answers the same calls plus
``attach`` (an engine states its chunk geometry) and ``fetch`` (push a
prompt's held chunks into the engine's store).

:func:`call_all` sends one request on each of several clients, then polls
all their sockets until a single deadline, so asking N peers costs one
bound, not N. A call fails in one of two ways, both
:class:`~fabric.errors.PeerUnreachable`:

    PeerUnreachable
     +-- NoConnection   nothing took the request within the bound: no
     |                  connection to the endpoint (nothing listens there,
     |                  a wrong port) or the peer stopped reading and its
     |                  queue is full. Sockets set ZMQ_IMMEDIATE, so a
     |                  request is never queued for a peer not connected.
     +-- ReplyTimeout   the request was sent, the answer did not come in
                        time (a peer that is busy, stalled or hung).

A ``Refused`` reply raises :class:`TransferError` (:class:`LayoutMismatch`
for a layout refusal; :class:`PeerBusy` when the peer's queue for it was
full: transient, nothing was done, ask again later). With ``secret`` (the engines'
``TransferConfig.secret``) requests are signed and replies verified; a
secret that differs from the engine's fails the call at once with a
:class:`TransferError` saying so.

Late replies: a client keeps its socket after a timeout (rebuilding it
would make every late answer cost the next call a reconnect). Each request
carries a sequence number from the client's own counter and a reply is
taken only for the request it names; a reply to an earlier request that
arrives during a later call is read and dropped, so a late answer is never
taken for a later call's.

Requests in flight across calls (the engine's scheduler, which cannot wait
inside one vLLM step): :meth:`StoreClient.post` sends without waiting and
:meth:`StoreClient.take_reply` takes the answer once it came, by sequence
number, so several requests can be in flight on one socket; every reply
read is kept for the request it names until taken or :meth:`forgotten
<StoreClient.forget>`. :func:`wait_ready` waits (bounded) for any of them::

    client.post(msg)                 # False: no connection takes it now
    wait_ready([client], 5)          # a reply came, or 5 ms passed
    client.take_reply(msg.seq)       # the reply (or its error), or None

Queues are small (``SOCKET_HWM``) and ``LINGER`` is 0: requests still
queued in a client's socket die with it when it closes, and a connection
the peer stopped reading pushes back within a few requests. (What the peer
already read stays there and runs when it resumes: the engine's scheduler
caps its requests in flight per peer, :mod:`fabric.integrations.vllm.tier_client`.)
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TypeVar

import zmq

from fabric.errors import (
    FabricError,
    LayoutMismatch,
    PeerUnreachable,
    ProtocolError,
    TransferError,
)
from fabric.kv.identity import BASE, KeyIdentity
from fabric.transfer import protocol as proto
from fabric.transfer.client import decode_reply
from fabric.transfer.offload import BUSY

DEFAULT_TIMEOUT_MS = 2000
# NOTE: a client has a few requests in flight at most (one per call; the
# scheduler caps its lookups per rank): nothing needs a deep queue, and a
# shallow one keeps little to run late, or to drop, when a peer stalls.
SOCKET_HWM = 16

ReplyT = TypeVar("ReplyT")


class NoConnection(PeerUnreachable):
    """No connection took the request within the bound (nothing listens at
    the endpoint, or the peer stopped reading and its queue is full)."""


class ReplyTimeout(PeerUnreachable):
    """The request was sent; its answer did not arrive within the bound."""


class PeerBusy(TransferError):
    """The peer refused the request for now (``Refused(code="busy")``: the
    queue it runs on was full): nothing was done, ask again later."""


def resolve_endpoint(value: str | None) -> str | None:
    """A store's control endpoint from ``host:port``, ``tcp://host:port`` or
    the path of an endpoint file (None while that file is missing)."""
    value = (value or "").strip()
    if not value or value.startswith("tcp://"):
        return value or None
    host, _, port = value.rpartition(":")
    if host and port.isdigit() and "/" not in value:
        return f"tcp://{value}"
    try:
        text = Path(value).read_text().strip()
    except OSError:
        return None
    return text if text.startswith("tcp://") else f"tcp://{text}" if text else None


def write_endpoint(path: Path, endpoint: str) -> None:
    """Leave ``endpoint`` in ``path`` atomically (readers never see half of it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(endpoint)
    os.replace(tmp, path)


class StoreClient:
    """Synchronous, thread-safe client of one engine's reuse tier."""

    def __init__(
        self,
        endpoint: str,
        *,
        timeout_ms: int = DEFAULT_TIMEOUT_MS,
        max_message_bytes: int = proto.DEFAULT_MAX_MESSAGE_BYTES,
        secret: str | None = None,
    ) -> None:
        self.endpoint, self.timeout_ms = endpoint, timeout_ms
        self.max_message_bytes = max_message_bytes
        self.codec = proto.Codec(secret, max_message_bytes)
        self._lock = threading.Lock()
        self._seq = itertools.count(1)
        self._sock: zmq.Socket[bytes] | None = None
        self._outstanding: set[int] = set()  # seqs sent whose reply is awaited
        self._replies: dict[int, proto.Message | FabricError] = {}  # read, not taken

    def lookup_message(
        self,
        token_ids: Sequence[int],
        *,
        hold: str | None = None,
        lease_ms: int = 30_000,
        identity: KeyIdentity = BASE,
    ) -> proto.Lookup:
        """The Lookup :meth:`lookup` sends (for :func:`call_all`, :meth:`post`)."""
        return proto.Lookup(
            next(self._seq),
            hold or "",
            list(token_ids),
            hold is not None,
            lease_ms,
            identity.encode(),
        )

    def lookup(
        self,
        token_ids: Sequence[int],
        *,
        hold: str | None = None,
        lease_ms: int = 30_000,
        identity: KeyIdentity = BASE,
    ) -> proto.LookupResult:
        """How many leading full chunks of ``token_ids`` (keyed with
        ``identity``) the engine holds."""
        msg = self.lookup_message(token_ids, hold=hold, lease_ms=lease_ms, identity=identity)
        return _expect(self._call(msg), proto.LookupResult)

    def release(self, request_id: str) -> bool:
        """Drop a hold; whether there was one."""
        return bool(self._done(proto.Release(next(self._seq), request_id)))

    def clear(self, tier: str = "all") -> int:
        """Empty a tier of the engine's store; chunks removed."""
        return self._done(proto.Clear(next(self._seq), tier))

    def pin(
        self, token_ids: Sequence[int], *, pin: bool = True, identity: KeyIdentity = BASE
    ) -> int:
        """Pin (or unpin) a prompt's leading chunks; chunks affected."""
        return self._done(proto.Pin(next(self._seq), list(token_ids), pin, identity.encode()))

    def prefill_state(
        self, request_ids: Sequence[str], state: str, *, ttl_ms: int, reason: str = ""
    ) -> int:
        """Tell a decoder how the prefills of ``request_ids`` stand
        (``proto.PrefillState``); how many it recorded."""
        msg = proto.PrefillState(next(self._seq), list(request_ids), state, ttl_ms, reason)
        return self._done(msg)

    def stats(self) -> dict[str, int]:
        """The engine's store occupancy (``reserved``, ``filled``, ...) and counters."""
        reply = _expect(self._call(proto.Stats(next(self._seq))), proto.StatsReply)
        return dict(reply.stats)

    def attach(
        self, fingerprint: str, chunk_tokens: int, chunk_bytes: int, endpoint: str
    ) -> proto.Attached:
        """Tell a shared store this engine's geometry; TransferError if refused."""
        msg = proto.Attach(next(self._seq), fingerprint, chunk_tokens, chunk_bytes, endpoint)
        return _expect(self._call(msg), proto.Attached)

    def fetch(
        self,
        transfer_id: str,
        token_ids: Sequence[int],
        endpoint: str,
        *,
        min_chunks: int = 0,
        lease_ms: int = 30_000,
        identity: KeyIdentity = BASE,
    ) -> proto.Fetching:
        """Ask a shared store to push a prompt's held chunks to ``endpoint``."""
        msg = self.fetch_message(
            transfer_id,
            token_ids,
            endpoint,
            min_chunks=min_chunks,
            lease_ms=lease_ms,
            identity=identity,
        )
        return _expect(self._call(msg), proto.Fetching)

    def fetch_message(
        self,
        transfer_id: str,
        token_ids: Sequence[int],
        endpoint: str,
        *,
        min_chunks: int = 0,
        lease_ms: int = 30_000,
        identity: KeyIdentity = BASE,
    ) -> proto.Fetch:
        """The Fetch :meth:`fetch` sends (for :meth:`post`)."""
        return proto.Fetch(
            next(self._seq),
            transfer_id,
            list(token_ids),
            endpoint,
            min_chunks,
            lease_ms,
            identity.encode(),
        )

    def close(self) -> None:
        """Close the socket; requests still queued in it, and replies not
        taken, are dropped (a later call connects again)."""
        with self._lock:
            if self._sock is not None:
                self._sock.close(linger=0)
                self._sock = None
            self._outstanding.clear()
            self._replies.clear()

    # ------------------------------------------------------------ in flight
    def post(self, msg: proto.Message) -> bool:
        """Send ``msg`` without waiting for its reply (take it with
        :meth:`take_reply`). False when no connection takes it now (not
        connected yet or any more, or the peer's queue is full): nothing is
        queued, post it again later. Raises :class:`ProtocolError` for a
        message that cannot be encoded, :class:`TransferError` for a socket
        error."""
        frame = self.codec.encode(msg)
        with self._lock:
            return self._post(frame, _seq(msg))

    def take_reply(self, seq: int) -> proto.Message | FabricError | None:
        """The reply to the request ``seq`` posted, or why it has none (a
        refusal, a reply that failed to decode); None while it has not come."""
        with self._lock:
            self._read()
            return self._take(seq)

    def forget(self, seq: int) -> None:
        """Stop waiting for the reply to ``seq``: when it comes, it is dropped."""
        with self._lock:
            self._outstanding.discard(seq)
            self._replies.pop(seq, None)

    def in_flight(self) -> int:
        """Requests posted whose replies were neither taken nor forgotten."""
        with self._lock:
            return len(self._outstanding)

    def _post(self, frame: bytes, seq: int) -> bool:
        """Send one frame (caller holds ``_lock``); whether a connection took it."""
        try:
            self._socket().send(frame, zmq.NOBLOCK)
        except zmq.Again:
            return False  # NOTE: IMMEDIATE: not connected, or SNDHWM reached
        except zmq.ZMQError as exc:
            raise TransferError(f"{self.endpoint}: cannot send: {exc}") from exc
        self._outstanding.add(seq)
        return True

    def _take(self, seq: int) -> proto.Message | FabricError | None:
        """``seq``'s reply if it was read (caller holds ``_lock``)."""
        reply = self._replies.pop(seq, None)
        if reply is not None:
            self._outstanding.discard(seq)
        return reply

    def _read(self) -> None:
        """Read every reply queued (caller holds ``_lock``); keep those for
        requests in flight, drop the rest (answers to calls given up on)."""
        if self._sock is None:
            return
        while self._outstanding:
            try:
                frame = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError as exc:
                error = TransferError(f"{self.endpoint}: cannot receive: {exc}")
                for seq in self._outstanding - self._replies.keys():
                    self._replies[seq] = error
                return
            try:
                reply = decode_reply(self.codec, frame, self.endpoint)
            except FabricError as exc:
                self._keep(None, exc)
                continue
            if isinstance(reply, proto.Refused):
                # NOTE: seq -1: a refusal the peer could not tie to a request
                # (a bad signature): it answers the oldest request in flight.
                self._keep(
                    None if reply.seq == -1 else reply.seq, refusal_error(reply, self.endpoint)
                )
            else:
                self._keep(getattr(reply, "seq", None), reply)

    def _keep(self, seq: int | None, reply: proto.Message | FabricError) -> None:
        waiting = self._outstanding - self._replies.keys()
        if seq is None:
            seq = min(waiting, default=None)
        if seq is not None and seq in waiting:
            self._replies[seq] = reply

    def _done(self, msg: proto.Message) -> int:
        return _expect(self._call(msg), proto.Done).count

    def _call(self, msg: proto.Message) -> proto.Message:
        [result] = call_all([(self, msg)], self.timeout_ms)
        if isinstance(result, FabricError):
            raise result
        return result

    def _socket(self) -> zmq.Socket[bytes]:
        """The client's socket (caller holds ``_lock``), connected on first use."""
        if self._sock is None:
            sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            # NOTE: queue a request only on a completed connection: a request
            # for a peer that is not there fails (NoConnection) instead of
            # waiting in ZMQ to reach it after its caller has given up.
            sock.setsockopt(zmq.IMMEDIATE, 1)
            sock.setsockopt(zmq.SNDHWM, SOCKET_HWM)
            sock.setsockopt(zmq.RCVHWM, SOCKET_HWM)
            sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes + proto.SOCKET_SLACK_BYTES)
            sock.connect(self.endpoint)
            self._sock = sock
        return self._sock

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def lookup_all(
    clients: Sequence[StoreClient],
    token_ids: Sequence[int],
    *,
    hold: str | None = None,
    lease_ms: int = 30_000,
    identity: KeyIdentity = BASE,
    timeout_ms: int | None = None,
) -> list[proto.LookupResult | FabricError]:
    """:meth:`StoreClient.lookup` on every client at once (one deadline);
    per client, its result or why it has none."""
    calls = [
        (c, c.lookup_message(token_ids, hold=hold, lease_ms=lease_ms, identity=identity))
        for c in clients
    ]
    results = call_all(calls, timeout_ms)
    return [_checked(result, proto.LookupResult) for result in results]


def call_all(
    calls: Sequence[tuple[StoreClient, proto.Message]], timeout_ms: int | None = None
) -> list[proto.Message | FabricError]:
    """Send each message on its client (distinct clients), then wait for all
    the answers until one deadline ``timeout_ms`` (default: the largest
    client's) from now. Per call, in order: its reply, or the error it got
    (:class:`NoConnection`, :class:`ReplyTimeout`, :class:`TransferError`
    for a refusal or a secret mismatch, :class:`ProtocolError`); one peer's
    failure never fails the others. An answer that comes later is dropped."""
    if timeout_ms is None:
        timeout_ms = max((client.timeout_ms for client, _ in calls), default=0)
    clients = [client for client, _ in calls]
    assert len({id(c) for c in clients}) == len(clients), "one call per client"
    with contextlib.ExitStack() as locks:
        for client in sorted(clients, key=id):  # NOTE: one order: no deadlock
            locks.enter_context(client._lock)
        pending = [_Call(client, msg) for client, msg in calls]
        try:
            _exchange(pending, time.monotonic() + timeout_ms / 1000)
        finally:
            for call in pending:
                call.client._outstanding.discard(call.seq)
                call.client._replies.pop(call.seq, None)
    return [call.outcome(timeout_ms) for call in pending]


def wait_ready(
    receiving: Sequence[StoreClient], timeout_ms: float, sending: Sequence[StoreClient] = ()
) -> None:
    """Block until a reply can be read on one of ``receiving``, or one of
    ``sending`` can take a request, or ``timeout_ms`` passed (0: just look).
    For clients used by this thread only (the scheduler's)."""
    poller = zmq.Poller()
    for client in receiving:
        with client._lock:
            poller.register(client._socket(), zmq.POLLIN)
    for client in sending:
        with client._lock:
            poller.register(client._socket(), zmq.POLLOUT)
    poller.poll(max(0, math.ceil(timeout_ms)))


def _exchange(calls: list[_Call], deadline: float) -> None:
    """Send and receive until every call has its result or ``deadline`` passed."""
    for call in calls:
        call.try_send()
    while (waiting := [c for c in calls if c.result is None]) and (
        left := deadline - time.monotonic()
    ) > 0:
        poller = zmq.Poller()
        for call in waiting:
            poller.register(call.sock, zmq.POLLIN if call.sent else zmq.POLLOUT)
        ready = dict(poller.poll(max(1, math.ceil(left * 1000))))
        for call in waiting:
            if call.sock not in ready:
                continue
            if call.sent:
                call.receive()
            else:
                call.try_send()
    for call in calls:
        if call.sent:
            call.receive()  # NOTE: an answer that came with the deadline still counts


class _Call:
    """One request on one client's socket, within a :func:`call_all`
    (which holds the client's lock)."""

    def __init__(self, client: StoreClient, msg: proto.Message) -> None:
        self.client, self.msg = client, msg
        self.seq = _seq(msg)
        self.sent = False
        self.result: proto.Message | FabricError | None = None
        self.frame = b""
        try:
            self.frame = client.codec.encode(msg)
        except ProtocolError as exc:
            self.result = exc
        self.sock = client._socket()

    def try_send(self) -> None:
        if self.result is not None:
            return
        try:
            self.sent = self.client._post(self.frame, self.seq)
        except TransferError as exc:
            self.result = exc

    def receive(self) -> None:
        """Read every reply queued; keep the one for this request."""
        if self.result is None:
            self.client._read()
            self.result = self.client._take(self.seq)

    def outcome(self, timeout_ms: int) -> proto.Message | FabricError:
        if self.result is not None:
            return self.result
        endpoint, kind = self.client.endpoint, type(self.msg).__name__
        if not self.sent:
            return NoConnection(
                f"{endpoint}: no connection took {kind} in {timeout_ms} ms "
                "(nothing listening there, or the peer stopped reading)"
            )
        return ReplyTimeout(f"{endpoint}: no answer to {kind} in {timeout_ms} ms")


def _seq(msg: proto.Message) -> int:
    seq = getattr(msg, "seq", None)
    assert isinstance(seq, int), f"{type(msg).__name__} carries no seq"
    return seq


def refusal_error(reply: proto.Refused, endpoint: str) -> FabricError:
    """The error a refusal from ``endpoint`` stands for (:class:`PeerBusy`: ask again)."""
    if reply.code == proto.Refusal.LAYOUT_MISMATCH:
        return LayoutMismatch(f"{endpoint}: {reply.reason}")
    if reply.code == BUSY:
        return PeerBusy(f"{endpoint} refused: {reply.code}: {reply.reason}")
    return TransferError(f"{endpoint} refused: {reply.code}: {reply.reason}")


def _expect(reply: proto.Message, kind: type[ReplyT]) -> ReplyT:
    if not isinstance(reply, kind):
        raise ProtocolError(f"expected {kind.__name__}, got {type(reply).__name__}")
    return reply


def _checked(result: proto.Message | FabricError, kind: type[ReplyT]) -> ReplyT | FabricError:
    if isinstance(result, FabricError):
        return result
    try:
        return _expect(result, kind)
    except ProtocolError as exc:
        return exc
