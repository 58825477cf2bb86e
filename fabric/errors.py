"""Exceptions raised by fabric.

Every error fabric raises derives from :class:`FabricError`; library errors
(NIXL status strings, ZMQ errors, socket errors) are translated at the
boundary with ``raise X(...) from exc``.

    FabricError
     +-- ConfigError            bad configuration (names the field)
     +-- LayoutError            a KV cache fabric cannot describe or pack
     |    +-- LayoutMismatch    two sides disagree on model/dtype/geometry/TP
     +-- StoreError             chunk store misuse
     |    +-- CapacityError     no free slot (pool full, everything pinned)
     |    +-- SlotStateError    a slot used in a state that forbids it
     +-- TransferError          moving chunks between processes failed
     |    +-- PeerUnreachable   handshake or control request got no answer
     |    +-- TransferTimeout   a bounded wait ran out
     |    +-- ChecksumMismatch  bytes arrived but do not match their checksum
     |    +-- ReservationRefused the receiver said no (pool full, bad request)
     |    +-- ReservationExpired a lease ran out before the write completed
     |    +-- TransportFailed   the data plane reported an error
     |         +-- PeerDisconnected  it lost (or never loaded) the peer: load it again
     +-- ProtocolError          a wire message that cannot be accepted
     |    |                     (wrong version, garbage, too large)
     |    +-- SignatureError    its HMAC tag is wrong, missing or unexpected
     +-- LaunchError            a process fabric started did not come up
     |    +-- ProcessExited     it exited while we waited (message: log tail)
     |    +-- StartTimeout      it was not healthy in time (also a TimeoutError)
     +-- ProxyError             a request the proxy answers with an HTTP error
                                (``fabric.router.errors``: status, OpenAI-style body)
"""

from __future__ import annotations


class FabricError(Exception):
    """Base class of every error fabric raises."""


class ConfigError(FabricError, ValueError):
    """Invalid configuration. The message names the offending field."""


class LayoutError(FabricError):
    """A KV cache that fabric cannot describe, or a pack/unpack misuse."""


class LayoutMismatch(LayoutError):
    """Two engines' KV layouts differ (model, dtype, block size, TP...)."""


class StoreError(FabricError):
    """Chunk store misuse."""


class CapacityError(StoreError):
    """No slot can be had: the pool is full of reserved or pinned chunks."""


class SlotStateError(StoreError):
    """A slot was used in a state that does not allow it."""


class TransferError(FabricError):
    """Moving chunks between processes failed."""


class PeerUnreachable(TransferError):
    """The peer did not answer a handshake or control request in time."""


class TransferTimeout(TransferError):
    """A bounded wait in the transfer path ran out."""


class ChecksumMismatch(TransferError):
    """Chunk bytes arrived but do not match the checksum sent with them."""


class ReservationRefused(TransferError):
    """The receiver refused a reservation; ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"reservation refused: {reason}")
        self.reason = reason


class ReservationExpired(TransferError):
    """A reservation's lease ran out (or it was cancelled) before completion."""


class TransportFailed(TransferError):
    """The data plane (NIXL/UCX or TCP) reported a failure."""


class PeerDisconnected(TransportFailed):
    """The data plane has no usable route to the peer (NIXL marks a remote
    agent disconnected once UCX dropped its connection, and refuses writes
    to it until its metadata is loaded again); nothing of the write was sent."""


class ProtocolError(FabricError):
    """A control message was refused: wrong version, garbage, or too large."""


class SignatureError(ProtocolError):
    """A frame's HMAC tag is wrong, missing (a secret is set here) or
    unexpected (none is set here): the two sides do not share a secret."""


class ReplayError(SignatureError):
    """A signed frame whose stamp is outside the replay window, or whose nonce
    was accepted before: a replay (or clocks out of sync)."""


class LaunchError(FabricError):
    """A process fabric started did not come up."""


class ProcessExited(LaunchError):
    """The process exited while we waited for it; the message carries its log tail."""


class StartTimeout(LaunchError, TimeoutError):
    """The process did not become healthy within the timeout."""
