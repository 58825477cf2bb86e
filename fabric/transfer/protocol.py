"""Control-channel wire format.

Every control message and every data-plane notification travels as one frame:

    +-------+---------+------------------------------------------+
    | magic | version | msgpack payload (msgspec tagged union)    |
    | "FB"  | u16 LE  | array-like Struct, tag first              |
    +-------+---------+------------------------------------------+
      2 B      2 B      <= max_message_bytes - 4

The magic and version are checked before anything else is decoded; a frame
that fails any check raises :class:`~fabric.errors.ProtocolError`, and the
server answers it with ``Refused`` and counts it. Payloads are msgspec
Structs, never pickle. ``seq`` pairs a reply with its request, so a reply that
arrives after its request timed out is recognised and dropped.
"""

from __future__ import annotations

import struct

import msgspec

from fabric.errors import ProtocolError

PROTOCOL_VERSION = 1
MAGIC = b"FB"
_HEADER = struct.Struct("<2sH")
DEFAULT_MAX_MESSAGE_BYTES = 1 << 20


class Hello(msgspec.Struct, tag="hello", array_like=True, frozen=True):
    """Sender -> receiver: who I am and how my data plane is reached."""

    seq: int
    agent_name: str
    transport: str
    fingerprint: str
    data_descriptor: bytes


class HelloAck(msgspec.Struct, tag="hello_ack", array_like=True, frozen=True):
    """Receiver -> sender: the receiver's data plane and slot pool geometry."""

    seq: int
    agent_name: str
    transport: str
    fingerprint: str
    data_descriptor: bytes
    slot_bytes: int
    num_slots: int


class Reserve(msgspec.Struct, tag="reserve", array_like=True, frozen=True):
    """Ask for one slot per chunk key; ``nbytes`` is each chunk's size."""

    seq: int
    request_id: str
    keys: list[bytes]
    nbytes: list[int]
    lease_ms: int


class Reserved(msgspec.Struct, tag="reserved", array_like=True, frozen=True):
    """Slots granted for a Reserve (one per key, in order)."""

    seq: int
    request_id: str
    slots: list[int]
    generations: list[int]
    already_present: list[bool]
    lease_ms: int


class Refused(msgspec.Struct, tag="refused", array_like=True, frozen=True):
    """A request the receiver will not serve; ``code`` is machine-readable."""

    seq: int
    request_id: str
    code: str
    reason: str


class Cancel(msgspec.Struct, tag="cancel", array_like=True, frozen=True):
    """Give a reservation back before it expires."""

    seq: int
    request_id: str


class Heartbeat(msgspec.Struct, tag="heartbeat", array_like=True, frozen=True):
    """Extend a reservation's lease while the sender still works on it."""

    seq: int
    request_id: str
    lease_ms: int


class Ack(msgspec.Struct, tag="ack", array_like=True, frozen=True):
    """Reply to Cancel/Heartbeat: whether the reservation existed."""

    seq: int
    request_id: str
    ok: bool


class WriteDone(msgspec.Struct, tag="write_done", array_like=True, frozen=True):
    """Data-plane notification: chunks ``indices`` of a reservation landed."""

    request_id: str
    indices: list[int]
    generations: list[int]
    checksums: list[int]


class Lookup(msgspec.Struct, tag="lookup", array_like=True, frozen=True):
    """How many leading full chunks of ``token_ids`` does the store hold?

    Needs no Hello: the engine's own scheduler and the proxy ask it. With
    ``hold`` the receiver brings disk hits into memory and keeps every hit
    chunk referenced for ``request_id`` (``lease_ms`` at most) until the
    engine's worker loads them or ``Release`` drops them.
    """

    seq: int
    request_id: str
    token_ids: list[int]
    hold: bool
    lease_ms: int


class LookupResult(msgspec.Struct, tag="lookup_result", array_like=True, frozen=True):
    """Reply to Lookup: ``hit_chunks`` leading chunks present, of which
    ``disk_chunks`` came from (or are only on) the disk tier."""

    seq: int
    request_id: str
    chunk_tokens: int
    hit_chunks: int
    disk_chunks: int
    held: bool


class Release(msgspec.Struct, tag="release", array_like=True, frozen=True):
    """Drop the chunks a Lookup held for ``request_id``."""

    seq: int
    request_id: str


class Clear(msgspec.Struct, tag="clear", array_like=True, frozen=True):
    """Empty a tier: ``"memory"``, ``"disk"`` or ``"all"``."""

    seq: int
    tier: str


class Pin(msgspec.Struct, tag="pin", array_like=True, frozen=True):
    """Pin (or, with ``pin=False``, unpin) the present full chunks of a prompt."""

    seq: int
    token_ids: list[int]
    pin: bool


class Done(msgspec.Struct, tag="done", array_like=True, frozen=True):
    """Reply to Release/Clear/Pin: how many chunks (or holds) it touched."""

    seq: int
    count: int


Message = (
    Hello
    | HelloAck
    | Reserve
    | Reserved
    | Refused
    | Cancel
    | Heartbeat
    | Ack
    | WriteDone
    | Lookup
    | LookupResult
    | Release
    | Clear
    | Pin
    | Done
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    """Frame ``msg`` with magic and version."""
    return _HEADER.pack(MAGIC, PROTOCOL_VERSION) + _encoder.encode(msg)


def decode(frame: bytes, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> Message:
    """Check size, magic and version, then decode; ProtocolError on any failure."""
    if len(frame) > max_bytes:
        raise ProtocolError(f"message of {len(frame)} bytes exceeds limit {max_bytes}")
    if len(frame) < _HEADER.size:
        raise ProtocolError(f"message of {len(frame)} bytes is shorter than its header")
    magic, version = _HEADER.unpack_from(frame)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r}")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version}, this side speaks {PROTOCOL_VERSION}")
    try:
        return _decoder.decode(memoryview(frame)[_HEADER.size :])
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"undecodable message: {exc}") from exc
