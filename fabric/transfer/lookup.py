"""Client of an engine's reuse tier over its control channel.

The engine's own scheduler asks its workers (which own the store) before it
computes a prompt; the proxy asks every engine for cache-aware routing and
its admin endpoints. No Hello and no data plane: one DEALER socket per
endpoint, one request at a time per client, every call bounded by
``timeout_ms``::

    client = StoreClient("tcp://127.0.0.1:5600")
    result = client.lookup(token_ids)             # proto.LookupResult
    result.hit_chunks * result.chunk_tokens       # prefix tokens held
    client.lookup(token_ids, hold="req-1")        # and keep them for req-1
    client.release("req-1"); client.clear("memory"); client.pin(token_ids)

    # every TP rank at once, one deadline for all:
    results = lookup_all(clients, token_ids, hold="req-1", timeout_ms=50)

A shared store (:mod:`fabric.store.service`) answers the same calls plus
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
for a layout refusal). With ``secret`` (the engines'
``TransferConfig.secret``) requests are signed and replies verified; a
secret that differs from the engine's fails the call at once with a
:class:`TransferError` saying so.

Late replies: a client keeps its socket after a timeout (rebuilding it
would make every late answer cost the next call a reconnect). Each request
carries a sequence number from the client's own counter and a reply is
taken only for the request it names; a reply to an earlier request that
arrives during a later call is read and dropped, so a late answer is never
taken for a later call's.
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

DEFAULT_TIMEOUT_MS = 2000

ReplyT = TypeVar("ReplyT")


class NoConnection(PeerUnreachable):
    """No connection took the request within the bound (nothing listens at
    the endpoint, or the peer stopped reading and its queue is full)."""


class ReplyTimeout(PeerUnreachable):
    """The request was sent; its answer did not arrive within the bound."""


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

    def lookup_message(
        self,
        token_ids: Sequence[int],
        *,
        hold: str | None = None,
        lease_ms: int = 30_000,
        identity: KeyIdentity = BASE,
    ) -> proto.Lookup:
        """The Lookup :meth:`lookup` sends (for :func:`call_all`)."""
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
        msg = proto.Fetch(
            next(self._seq),
            transfer_id,
            list(token_ids),
            endpoint,
            min_chunks,
            lease_ms,
            identity.encode(),
        )
        return _expect(self._call(msg), proto.Fetching)

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close(linger=0)
                self._sock = None

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
    failure never fails the others."""
    if timeout_ms is None:
        timeout_ms = max((client.timeout_ms for client, _ in calls), default=0)
    clients = [client for client, _ in calls]
    assert len({id(c) for c in clients}) == len(clients), "one call per client"
    with contextlib.ExitStack() as locks:
        for client in sorted(clients, key=id):  # NOTE: one order: no deadlock
            locks.enter_context(client._lock)
        pending = [_Call(client, msg) for client, msg in calls]
        _exchange(pending, time.monotonic() + timeout_ms / 1000)
    return [call.outcome(timeout_ms) for call in pending]


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
    """One request on one client's socket, within a :func:`call_all`."""

    def __init__(self, client: StoreClient, msg: proto.Message) -> None:
        self.client, self.msg = client, msg
        self.seq: int = msg.seq  # type: ignore[union-attr]
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
            self.sock.send(self.frame, zmq.NOBLOCK)
        except zmq.Again:
            return  # not connected (yet): polled for POLLOUT until the deadline
        except zmq.ZMQError as exc:
            self.result = TransferError(f"{self.client.endpoint}: cannot send: {exc}")
            return
        self.sent = True

    def receive(self) -> None:
        """Read every reply queued; keep the one for this request."""
        while self.result is None:
            try:
                frame = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError as exc:
                self.result = TransferError(f"{self.client.endpoint}: cannot receive: {exc}")
                return
            try:
                self.result = self._match(
                    decode_reply(self.client.codec, frame, self.client.endpoint)
                )
            except FabricError as exc:
                self.result = exc

    def _match(self, reply: proto.Message) -> proto.Message | None:
        """``reply`` if it answers this request, None for a stale one."""
        endpoint = self.client.endpoint
        if isinstance(reply, proto.Refused) and reply.seq in (self.seq, -1):
            if reply.code == "layout_mismatch":
                raise LayoutMismatch(f"{endpoint}: {reply.reason}")
            raise TransferError(f"{endpoint} refused: {reply.code}: {reply.reason}")
        if getattr(reply, "seq", None) != self.seq:
            return None  # NOTE: the answer to an earlier call that timed out
        return reply

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
