"""How a transfer server answers the reuse tier's control messages.

Lookup, Release, Clear and Pin need no Hello: this engine's scheduler and
the proxy ask them. :func:`blocks` says which of them may read or delete
disk files or wait for the disk writer, which the server runs off its loop
(:mod:`fabric.transfer.offload`), and :func:`is_admin` on which queue: the
scheduler's Lookups (which it waits for inside a vLLM step) never queue
behind an operator's Clear or Pin (a Clear may wait a minute for the disk
writer, then unlink thousands of files). :func:`tier_reply` answers any of
them, on whichever thread.

A scheduler in the server's own process (vLLM at TP 1 runs its worker in
the engine-core process) need not ask over the socket: :func:`in_process`
finds a started server by its endpoint, and
:meth:`~fabric.transfer.server.TransferServer.answer_here` answers a
request that touches no disk on the caller's thread.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

from fabric.errors import FabricError
from fabric.kv.identity import KeyIdentity
from fabric.transfer import protocol as proto

if TYPE_CHECKING:
    from fabric.store.tier import TieredStore
    from fabric.transfer.server import TransferServer

TierRequest = proto.Lookup | proto.Release | proto.Clear | proto.Pin

# NOTE: this process's started servers, by endpoint (a closed one is gone at once)
_SERVERS: weakref.WeakValueDictionary[str, TransferServer] = weakref.WeakValueDictionary()


def serve_in_process(server: TransferServer) -> None:
    """Let this process's schedulers find ``server`` by its endpoint."""
    _SERVERS[server.endpoint] = server


def leave_process(server: TransferServer) -> None:
    if _SERVERS.get(server.endpoint) is server:
        del _SERVERS[server.endpoint]


def in_process(endpoint: str) -> TransferServer | None:
    """The started server of this process bound at ``endpoint``, if any."""
    return _SERVERS.get(endpoint)


def blocks(tier: TieredStore, msg: proto.Message) -> bool:
    """Whether answering ``msg`` may read or delete disk files, or wait for
    the disk writer (a Clear flushes it first)."""
    if tier.disk is None:
        return False
    if isinstance(msg, proto.Lookup):
        return msg.hold
    if isinstance(msg, proto.Pin):
        return msg.pin
    return isinstance(msg, proto.Clear)


def is_admin(msg: proto.Message) -> bool:
    """Whether ``msg`` is an operator's request (Clear, Pin): run on the
    server's admin queue, never ahead of (or in the way of) a Lookup."""
    return isinstance(msg, proto.Clear | proto.Pin)


def tier_reply(tier: TieredStore, msg: TierRequest) -> proto.Message:
    """The answer of the reuse tier to ``msg`` (on the loop or off it)."""
    try:
        if isinstance(msg, proto.Lookup):
            hit = tier.lookup(
                msg.token_ids,
                hold=msg.request_id if msg.hold else None,
                lease_ms=msg.lease_ms,
                identity=KeyIdentity.decode(msg.identity),
            )
            return proto.LookupResult(
                msg.seq, msg.request_id, tier.chunk_tokens, hit.chunks, hit.disk, bool(hit.slots)
            )
        if isinstance(msg, proto.Release):
            return proto.Done(msg.seq, int(tier.release_hold(msg.request_id)))
        if isinstance(msg, proto.Clear):
            return proto.Done(msg.seq, tier.clear(msg.tier))
        identity = KeyIdentity.decode(msg.identity)
        return proto.Done(msg.seq, tier.pin(msg.token_ids, pin=msg.pin, identity=identity))
    except (ValueError, FabricError) as exc:
        return proto.Refused(msg.seq, "", proto.Refusal.BAD_REQUEST, str(exc))
