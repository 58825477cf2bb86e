"""Client of an engine's reuse tier over its control channel.

The engine's own scheduler asks its worker (which owns the store) before it
computes a prompt; the proxy asks every engine for cache-aware routing and
its admin endpoints. No Hello and no data plane: one DEALER socket per
endpoint, one request at a time, every call bounded by ``timeout_ms``::

    client = StoreClient("tcp://127.0.0.1:5600")
    result = client.lookup(token_ids)             # proto.LookupResult
    result.hit_chunks * result.chunk_tokens       # prefix tokens held
    client.lookup(token_ids, hold="req-1")        # and keep them for req-1
    client.release("req-1"); client.clear("memory"); client.pin(token_ids)

A shared store (:mod:`fabric.store.service`) answers the same calls plus
``attach`` (an engine states its chunk geometry) and ``fetch`` (push a
prompt's held chunks into the engine's store).

A call that gets no answer in time raises :class:`PeerUnreachable`; the
socket is then rebuilt, so a reply that arrives late is never taken for the
answer to a later call. A ``Refused`` reply raises :class:`TransferError`.
With ``secret`` (the engines' ``TransferConfig.secret``) requests are signed
and replies verified; a secret that differs from the engine's fails the call
at once with a :class:`TransferError` saying so.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import zmq

from fabric.errors import LayoutMismatch, PeerUnreachable, ProtocolError, TransferError
from fabric.kv.identity import BASE, KeyIdentity
from fabric.transfer import protocol as proto
from fabric.transfer.client import decode_reply

DEFAULT_TIMEOUT_MS = 2000


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
        msg = proto.Lookup(
            next(self._seq),
            hold or "",
            list(token_ids),
            hold is not None,
            lease_ms,
            identity.encode(),
        )
        reply = self._call(msg)
        if not isinstance(reply, proto.LookupResult):
            raise ProtocolError(f"expected LookupResult, got {type(reply).__name__}")
        return reply

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
        reply = self._call(proto.Stats(next(self._seq)))
        if not isinstance(reply, proto.StatsReply):
            raise ProtocolError(f"expected StatsReply, got {type(reply).__name__}")
        return dict(reply.stats)

    def attach(
        self, fingerprint: str, chunk_tokens: int, chunk_bytes: int, endpoint: str
    ) -> proto.Attached:
        """Tell a shared store this engine's geometry; TransferError if refused."""
        msg = proto.Attach(next(self._seq), fingerprint, chunk_tokens, chunk_bytes, endpoint)
        reply = self._call(msg)
        if not isinstance(reply, proto.Attached):
            raise ProtocolError(f"expected Attached, got {type(reply).__name__}")
        return reply

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
        reply = self._call(msg)
        if not isinstance(reply, proto.Fetching):
            raise ProtocolError(f"expected Fetching, got {type(reply).__name__}")
        return reply

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close(linger=0)
                self._sock = None

    def _done(self, msg: proto.Message) -> int:
        reply = self._call(msg)
        if not isinstance(reply, proto.Done):
            raise ProtocolError(f"expected Done, got {type(reply).__name__}")
        return reply.count

    def _call(self, msg: proto.Message) -> proto.Message:
        seq = msg.seq  # type: ignore[union-attr]
        with self._lock:
            frame = self.codec.encode(msg)
            sock = self._socket()
            sock.send(frame)
            deadline = time.monotonic() + self.timeout_ms / 1000
            while (left := deadline - time.monotonic()) > 0:
                if not sock.poll(max(1, int(left * 1000))):
                    break
                reply = decode_reply(self.codec, sock.recv(), self.endpoint)
                if isinstance(reply, proto.Refused) and reply.seq in (seq, -1):
                    if reply.code == "layout_mismatch":
                        raise LayoutMismatch(f"{self.endpoint}: {reply.reason}")
                    raise TransferError(f"{self.endpoint} refused: {reply.code}: {reply.reason}")
                if getattr(reply, "seq", None) != seq:
                    continue  # a stale reply
                return reply
            sock.close(linger=0)
            self._sock = None
        raise PeerUnreachable(
            f"{self.endpoint}: no answer to {type(msg).__name__} in {self.timeout_ms} ms"
        )

    def _socket(self) -> zmq.Socket[bytes]:
        if self._sock is None:
            sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes + proto.SOCKET_SLACK_BYTES)
            sock.connect(self.endpoint)
            self._sock = sock
        return self._sock

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
