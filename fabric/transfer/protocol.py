"""Control-channel wire format.

Every control message and every data-plane notification travels as one frame:

    +-------+----------------+---------------+---------------------------+-------------------+
    | magic | version        | stamp         | msgpack payload           | tag (signed only) |
    | "FB"  | u16 LE         | (signed only) | msgspec tagged union,     | HMAC-SHA256 of    |
    |       | bits 0-14: 1   | u64 sent_ms,  | array-like Struct,        | every byte before |
    |       | (signed: 2)    | u64 nonce     | tag first                 | it                |
    |       | bit 15: signed |               |                           |                   |
    +-------+----------------+---------------+---------------------------+-------------------+
      2 B     2 B              0 or 16 B                                   0 or 32 B
      |<------------------------- at most max_message_bytes in all ------------------------>|

An unsigned frame is byte for byte the version-1 frame of earlier releases.
With a shared secret (``TransferConfig.secret``) every frame carries the
signed bit, a stamp (the sender's wall clock in ms and a random nonce) and a
trailing tag; the receiver checks size, magic, version and then the tag
(``hmac.compare_digest``) before a byte of msgpack is decoded, then the
stamp: a frame sent more than ``REPLAY_WINDOW_S`` from the receiver's clock
(hosts need synchronised clocks), or whose nonce this codec accepted within
the window, is refused (:class:`ReplayError`, a :class:`SignatureError`), so
a captured frame cannot be replayed.
A signed frame reaching a side without a secret, an unsigned one reaching a
side with one, and a wrong tag all raise :class:`SignatureError`, so a
secret configured on one side only fails at the first message, clearly: a
release without signing reads the signed bit as protocol version 32769.

Any other failed check raises :class:`~fabric.errors.ProtocolError`; the
server answers a bad frame with ``Refused`` and counts it. Payloads are
msgspec Structs, never pickle; integer fields are range-checked at decode
(token ids int32, sizes and indices non-negative, leases at most a day).
``seq`` pairs a reply with its request, so a reply that arrives after its
request timed out is recognised and dropped. Without a secret nothing is
authenticated: keep the control port on loopback (the default; a bind
beyond it needs a secret or ``insecure``).
"""

from __future__ import annotations

import enum
import hmac
import os
import struct
import threading
import time
from collections import deque
from typing import Annotated

import msgspec

from fabric.errors import ProtocolError, ReplayError, SignatureError
from fabric.kv.direct import CacheMap

# NOTE: Lookup, Pin and Fetch gained a trailing ``identity`` (default b""):
# an older peer's frames still decode, as requests of the base identity.
PROTOCOL_VERSION = 1
SIGNED_VERSION = 2
"""Signed frames (with their stamp) say version 2; unsigned frames stay version 1."""
MAGIC = b"FB"
FLAG_SIGNED = 0x8000
TAG_BYTES = 32
_HEADER = struct.Struct("<2sH")
_STAMP = struct.Struct("<QQ")  # sent_ms, nonce
REPLAY_WINDOW_S = 60.0
"""How far a signed frame's stamp may be from the receiver's clock (its nonce is
kept twice as long)."""
MAX_NONCES = 1 << 20
"""Nonces a codec remembers at most (the oldest go first past it)."""
DEFAULT_MAX_MESSAGE_BYTES = 1 << 20
MAX_LEASE_MS = 24 * 3600 * 1000
# ZMQ's MAXMSGSIZE is the limit plus this: frames a little over the limit
# reach the codec (which answers them); ZMQ drops larger ones unread.
SOCKET_SLACK_BYTES = 1024

# Range-checked field types (msgspec validates them while decoding).
Count = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
Index = Annotated[int, msgspec.Meta(ge=0, lt=2**31)]
U64 = Annotated[int, msgspec.Meta(ge=0)]  # msgpack ints stop at 2**64 - 1
LeaseMs = Annotated[int, msgspec.Meta(ge=1, le=MAX_LEASE_MS)]
TokenId = Annotated[int, msgspec.Meta(ge=-(2**31), lt=2**31)]
Key = Annotated[bytes, msgspec.Meta(max_length=64)]
RequestId = Annotated[str, msgspec.Meta(max_length=1024)]
Name = Annotated[str, msgspec.Meta(max_length=1024)]
# A KeyIdentity's wire form (fabric.kv.identity), decoded by the receiver.
IdentityBytes = Annotated[bytes, msgspec.Meta(max_length=64 * 1024)]


CHECKSUM_HINT = "give both the same kind of pool_device (host: cpu or pinned, or cuda)"
"""How to mend a link whose two pools hash chunks differently (Hello.checksum)."""


class Hello(msgspec.Struct, tag="hello", array_like=True, frozen=True):
    """Sender -> receiver: who I am and how my data plane is reached."""

    seq: int
    agent_name: Name
    transport: Name
    fingerprint: Name
    data_descriptor: bytes
    # NOTE: last and defaulted, so a Hello without it (an older sender) reads
    # as xxh3, the only checksum there was
    checksum: Name = "xxh3"  # the sender's pool's: xxh3 (host) or fold64 (VRAM)


class HelloAck(msgspec.Struct, tag="hello_ack", array_like=True, frozen=True):
    """Receiver -> sender: the receiver's data plane and slot pool geometry."""

    seq: int
    agent_name: Name
    transport: Name
    fingerprint: Name
    data_descriptor: bytes
    slot_bytes: Count
    num_slots: Count
    checksum: Name = "xxh3"  # the receiver's pool's (see Hello.checksum)
    reads: bool = False  # it READs offered chunks (``Offer``); False from a peer before the field


class Reserve(msgspec.Struct, tag="reserve", array_like=True, frozen=True):
    """Ask for one slot per chunk key; ``nbytes`` is each chunk's size."""

    seq: int
    request_id: RequestId
    keys: list[Key]
    nbytes: list[Count]
    lease_ms: LeaseMs


class Reserved(msgspec.Struct, tag="reserved", array_like=True, frozen=True):
    """Slots granted for a Reserve (one per key, in order)."""

    seq: int
    request_id: RequestId
    slots: list[Index]
    generations: list[Count]
    already_present: list[bool]
    lease_ms: LeaseMs


class Refusal(enum.StrEnum):
    """Why a request was refused: ``Refused.code`` (``reason`` says more, in words)."""

    BAD_MESSAGE = "bad_message"  # a frame or message that cannot be accepted
    BAD_SIGNATURE = "bad_signature"  # its HMAC tag is wrong, missing or unexpected
    NO_HELLO = "no_hello"  # a data-plane request before Hello
    LAYOUT_MISMATCH = "layout_mismatch"  # the two sides' KV layouts differ
    TRANSPORT_MISMATCH = "transport_mismatch"  # the two sides' data planes differ
    BAD_DESCRIPTOR = "bad_descriptor"  # a data-plane descriptor that does not load
    BAD_REQUEST = "bad_request"  # a well-formed request that makes no sense
    CAPACITY = "capacity"  # no free slot for a Reserve
    DUPLICATE = "duplicate"  # a Reserve for a live reservation's transfer
    RELEASED = "released"  # a Reserve for a transfer its consumer released
    FAULT_INJECTED = "fault_injected"  # refused on purpose (fault injection)
    NO_TIER = "no_tier"  # a tier call to an engine that keeps no reuse tier
    UNBOUND = "unbound"  # a shared store no engine attached to yet
    BUSY = "busy"  # its queue is full: nothing was done, ask again later
    CLOSING = "closing"  # the server is closing
    INTERNAL_ERROR = "internal_error"  # serving it raised
    READ_FAILED = "read_failed"  # an offered chunk's READ failed, timed out or was ended


class Refused(msgspec.Struct, tag="refused", array_like=True, frozen=True):
    """A request the receiver will not serve; ``code`` is a :class:`Refusal`
    (a plain string on the wire: a code a newer peer adds still decodes)."""

    seq: int
    request_id: RequestId
    code: str
    reason: str


class Cancel(msgspec.Struct, tag="cancel", array_like=True, frozen=True):
    """Give a reservation back before it expires."""

    seq: int
    request_id: RequestId


class Heartbeat(msgspec.Struct, tag="heartbeat", array_like=True, frozen=True):
    """Extend a reservation's lease while the sender still works on it."""

    seq: int
    request_id: RequestId
    lease_ms: LeaseMs


class Ack(msgspec.Struct, tag="ack", array_like=True, frozen=True):
    """Reply to Cancel/Heartbeat: whether the reservation existed."""

    seq: int
    request_id: RequestId
    ok: bool


class WriteDone(msgspec.Struct, tag="write_done", array_like=True, frozen=True):
    """Data-plane notification: chunks ``indices`` of a reservation landed.

    ``starts``: the first byte of each chunk this write carried (bytes
    before it came in ``WritePart`` writes that completed earlier); empty
    (an older sender) or 0: the whole chunk. A receiver that used a chunk's
    bytes before this write must not trust them when it rewrote them."""

    request_id: RequestId
    indices: list[Index]
    generations: list[Count]
    checksums: list[U64]
    starts: list[Count] = []


class WritePart(msgspec.Struct, tag="write_part", array_like=True, frozen=True):
    """Data-plane notification: the leading ``layers`` layers of chunk
    ``index`` of a reservation landed (a prefiller writes each layer group
    as it packs it, before it knows the chunk's checksum). A hint only: the
    chunk counts once its ``WriteDone`` came and its checksum matched; a
    receiver that does not know this message drops it."""

    request_id: RequestId
    index: Index
    generation: Count
    layers: Count


class Offer(msgspec.Struct, tag="offer", array_like=True, frozen=True):
    """Sender -> receiver (direct reads): chunk ``index`` of a reservation is
    final in the sender's paged cache, in blocks ``block_ids`` of the cache
    ``cache`` describes; ``checksum`` is the xxh3-64 of its bytes in chunk
    order (the packed chunk's). The receiver READs them into the chunk's
    slot (reserved at ``generation``) and verifies them as a written chunk;
    it answers (``Ack``, or ``Refused``) once the read ended, so the sender
    keeps the blocks until then. A receiver that does not read refuses it.

    ``layers`` (a prefiller offering each layer group while its forward
    still runs): only the leading ``layers`` layers are final yet; the
    receiver READs those it has not read (the chunk's bytes up to them)
    and takes them as ``WritePart`` says, and ``checksum`` means nothing.
    0 (an older sender) or the layer count: the whole chunk, its rest read
    now, then verified with ``checksum``.

    ``regions``: the sender data plane's region descriptor (its cache's
    registration), which its Hello's descriptor never holds: a peer learns
    it only once the sender checked its HelloAck and offers it a chunk."""

    seq: int
    request_id: RequestId
    index: Index
    generation: Count
    checksum: U64
    block_ids: Annotated[list[Index], msgspec.Meta(max_length=1 << 16)]
    cache: CacheMap
    layers: Count = 0
    regions: Annotated[bytes, msgspec.Meta(max_length=1 << 16)] = b""


class Lookup(msgspec.Struct, tag="lookup", array_like=True, frozen=True):
    """How many leading full chunks of ``token_ids`` does the store hold?

    Needs no Hello: the engine's own scheduler and the proxy ask it. With
    ``hold`` the receiver brings disk hits into memory and keeps every hit
    chunk referenced for ``request_id`` (``lease_ms`` at most) until the
    engine's worker loads them or ``Release`` drops them. ``identity``: the
    request's :class:`~fabric.kv.identity.KeyIdentity` (``encode()``; b""
    for a base-model request without salt).
    """

    seq: int
    request_id: RequestId
    token_ids: list[TokenId]
    hold: bool
    lease_ms: LeaseMs
    identity: IdentityBytes = b""


class LookupResult(msgspec.Struct, tag="lookup_result", array_like=True, frozen=True):
    """Reply to Lookup: ``hit_chunks`` leading chunks present, of which
    ``disk_chunks`` came from (or are only on) the disk tier."""

    seq: int
    request_id: RequestId
    chunk_tokens: Count
    hit_chunks: Count
    disk_chunks: Count
    held: bool


class Release(msgspec.Struct, tag="release", array_like=True, frozen=True):
    """Drop the chunks a Lookup held for ``request_id``."""

    seq: int
    request_id: RequestId


class Clear(msgspec.Struct, tag="clear", array_like=True, frozen=True):
    """Empty a tier: ``"memory"``, ``"disk"`` or ``"all"``."""

    seq: int
    tier: Name


class Pin(msgspec.Struct, tag="pin", array_like=True, frozen=True):
    """Pin (or, with ``pin=False``, unpin) the present full chunks of a prompt."""

    seq: int
    token_ids: list[TokenId]
    pin: bool
    identity: IdentityBytes = b""


class PrefillState(msgspec.Struct, tag="prefill_state", array_like=True, frozen=True):
    """Proxy -> a decoder's transfer server: where the prefills of these
    transfers stand, for the decoder's loads that wait for them (a decoder
    admitted at dispatch allocates its blocks before the prefiller has
    pushed anything). Needs no Hello. ``state``:

    - ``running``: the prefiller has the request; expect its chunks, and
      another word, within ``ttl_ms`` (the proxy says it again meanwhile);
    - ``done``: the prefiller answered; what it pushed is on its way;
    - ``failed``: nothing more will come (``reason``): fail the load now.

    ``done`` and ``failed`` are final; a ``running`` after them changes nothing.
    Answered with ``Done(count)``: the transfers recorded.
    """

    seq: int
    request_ids: Annotated[list[RequestId], msgspec.Meta(max_length=4096)]
    state: Name
    ttl_ms: LeaseMs
    reason: Name = ""


PREFILL_STATES = ("running", "done", "failed")


class Done(msgspec.Struct, tag="done", array_like=True, frozen=True):
    """Reply to Release/Clear/Pin: how many chunks (or holds) it touched."""

    seq: int
    count: Count


class Stats(msgspec.Struct, tag="stats", array_like=True, frozen=True):
    """Ask for the receiver's store and server counters (no Hello needed)."""

    seq: int


class StatsReply(msgspec.Struct, tag="stats_reply", array_like=True, frozen=True):
    """Store occupancy by slot state, store/tier/disk/server counters: name -> value."""

    seq: int
    stats: dict[str, int]


class Attach(msgspec.Struct, tag="attach", array_like=True, frozen=True):
    """Engine -> shared store: my chunk geometry, and where my store serves.

    Needs no Hello. The first accepted Attach fixes a shared store's layout
    (``fingerprint``, ``chunk_tokens``, ``chunk_bytes``: its slot size); an
    engine that differs in any is refused with ``layout_mismatch``. Only
    engines that attached (by ``endpoint``) are sent chunks by ``Fetch``.
    """

    seq: int
    fingerprint: Name
    chunk_tokens: Count
    chunk_bytes: Count
    endpoint: Name


class Attached(msgspec.Struct, tag="attached", array_like=True, frozen=True):
    """Reply to Attach: the shared store's slot size and slot count."""

    seq: int
    slot_bytes: Count
    num_slots: Count


class Fetch(msgspec.Struct, tag="fetch", array_like=True, frozen=True):
    """Engine -> shared store: push me the leading full chunks of ``token_ids``.

    When the store holds more than ``min_chunks`` of them it reserves them on
    the attached engine at ``endpoint`` as ``transfer_id``, WRITEs them and
    notifies, as a prefiller pushes to a decoder; otherwise it sends nothing.
    """

    seq: int
    transfer_id: RequestId
    token_ids: list[TokenId]
    endpoint: Name
    min_chunks: Count
    lease_ms: LeaseMs
    identity: IdentityBytes = b""


class Fetching(msgspec.Struct, tag="fetching", array_like=True, frozen=True):
    """Reply to Fetch: ``hit_chunks`` leading chunks held; ``pushing`` when
    they are on their way (``hit_chunks > min_chunks``)."""

    seq: int
    transfer_id: RequestId
    chunk_tokens: Count
    hit_chunks: Count
    pushing: bool


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
    | WritePart
    | Offer
    | Lookup
    | LookupResult
    | Release
    | Clear
    | Pin
    | Done
    | Stats
    | StatsReply
    | Attach
    | Attached
    | Fetch
    | Fetching
    | PrefillState
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


class Codec:
    """Frames messages for one end of the channel: size limit and optional secret.

    Thread-safe (the nonces of the signed frames it accepted, its only
    state, are kept under a lock). ``encode`` refuses to build a frame over
    ``max_bytes``, so an oversized request fails here, not as a silent drop
    at the receiver.
    """

    def __init__(
        self, secret: str | bytes | None = None, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    ) -> None:
        key = secret.encode() if isinstance(secret, str) else secret
        if key is not None and not key:
            raise ValueError("an empty secret would sign nothing; use None for no secret")
        self._key = key
        self.max_bytes = max_bytes
        self._seen: set[int] = set()
        # (monotonic expiry, sent_ms, nonce), in arrival order
        self._expiries: deque[tuple[float, int, int]] = deque()
        self._floor_ms = -1  # frames stamped no later than this are refused (see _check_stamp)
        self._seen_lock = threading.Lock()

    @property
    def signed(self) -> bool:
        """Whether frames are signed (and unsigned ones refused)."""
        return self._key is not None

    def encode(self, msg: Message) -> bytes:
        """Frame ``msg``: header, payload and, with a secret, the tag."""
        try:
            payload = _encoder.encode(msg)
        except (OverflowError, TypeError, msgspec.EncodeError) as exc:
            raise ProtocolError(f"cannot encode {type(msg).__name__}: {exc}") from exc
        if self._key is None:
            frame = _HEADER.pack(MAGIC, PROTOCOL_VERSION) + payload
        else:
            stamp = _STAMP.pack(int(time.time() * 1000), int.from_bytes(os.urandom(8), "little"))
            body = _HEADER.pack(MAGIC, SIGNED_VERSION | FLAG_SIGNED) + stamp + payload
            frame = body + hmac.digest(self._key, body, "sha256")
        if len(frame) > self.max_bytes:
            raise ProtocolError(
                f"{type(msg).__name__} of {len(frame)} bytes exceeds limit {self.max_bytes}"
            )
        return frame

    def decode(self, frame: bytes, *, fresh: bool = True) -> Message:
        """Check size, magic, version, tag and stamp, then decode; ProtocolError
        on any failure. ``fresh=False`` skips the stamp's age (its nonce is
        still checked): for a notification, built when its write was posted
        and read once the write landed, maybe long after (a replayed one is
        refused by its write's fence: the slots' generations)."""
        payload = self._verify(frame, fresh)
        try:
            return _decoder.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ProtocolError(f"undecodable message: {exc}") from exc

    def _verify(self, frame: bytes, fresh: bool = True) -> memoryview:
        """The payload of ``frame`` once every check before decoding passed."""
        if len(frame) > self.max_bytes:
            raise ProtocolError(f"message of {len(frame)} bytes exceeds limit {self.max_bytes}")
        if len(frame) < _HEADER.size:
            raise ProtocolError(f"message of {len(frame)} bytes is shorter than its header")
        magic, version = _HEADER.unpack_from(frame)
        if magic != MAGIC:
            raise ProtocolError(f"bad magic {magic!r}")
        signed, version = bool(version & FLAG_SIGNED), version & ~FLAG_SIGNED
        if signed and version == PROTOCOL_VERSION and self._key is not None:
            raise SignatureError(
                "a signed frame without a replay stamp (an older fabric release): every "
                "side of a deployment needs the same release"
            )
        if version != (SIGNED_VERSION if signed else PROTOCOL_VERSION):
            speaks = f"{PROTOCOL_VERSION} (signed: {SIGNED_VERSION})"
            raise ProtocolError(f"protocol version {version}, this side speaks {speaks}")
        view = memoryview(frame)
        if self._key is None:
            if signed:
                raise SignatureError("frame is signed but this side has no secret")
            return view[_HEADER.size :]
        if not signed:
            raise SignatureError("frame is unsigned but this side requires a secret")
        if len(frame) < _HEADER.size + _STAMP.size + TAG_BYTES:
            raise SignatureError("signed frame is shorter than its stamp and tag")
        body, tag = view[:-TAG_BYTES], view[-TAG_BYTES:]
        if not hmac.compare_digest(hmac.digest(self._key, body, "sha256"), tag):
            raise SignatureError("frame signature does not match this side's secret")
        sent_ms, nonce = _STAMP.unpack_from(body, _HEADER.size)
        self._check_stamp(sent_ms, nonce, fresh)
        return body[_HEADER.size + _STAMP.size :]

    def _check_stamp(self, sent_ms: int, nonce: int, fresh: bool) -> None:
        """Refuse a stale frame or a nonce seen within the window; remember this one.

        At ``MAX_NONCES`` the oldest nonce goes, and frames stamped no later
        than it are refused from then on (a full cache narrows the window
        rather than reopening it).
        """
        skew = time.time() - sent_ms / 1000
        if fresh and abs(skew) > REPLAY_WINDOW_S:
            raise ReplayError(
                f"frame stamped {skew:+.0f} s from this side's clock (window "
                f"{REPLAY_WINDOW_S:g} s): a replay, or the hosts' clocks are not in sync"
            )
        now = time.monotonic()
        with self._seen_lock:
            while self._expiries and self._expiries[0][0] <= now:
                self._seen.discard(self._expiries.popleft()[2])
            if sent_ms <= self._floor_ms:
                raise ReplayError("frame older than the replay cache holds (a replay?)")
            if nonce in self._seen:
                raise ReplayError("frame replayed: its nonce was accepted before")
            while len(self._expiries) >= MAX_NONCES:
                _, old_ms, old = self._expiries.popleft()
                self._seen.discard(old)
                self._floor_ms = max(self._floor_ms, old_ms)
            self._seen.add(nonce)
            # NOTE: kept twice the window: a frame stays acceptable while |skew| <= window
            self._expiries.append((now + 2 * REPLAY_WINDOW_S, sent_ms, nonce))


_unsigned = Codec(max_bytes=2**63)


def encode(msg: Message) -> bytes:
    """Frame ``msg`` unsigned, without a size limit (see :class:`Codec`)."""
    return _unsigned.encode(msg)


def decode(frame: bytes, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> Message:
    """Decode an unsigned frame of at most ``max_bytes``; ProtocolError on any failure."""
    return Codec(max_bytes=max_bytes).decode(frame)
