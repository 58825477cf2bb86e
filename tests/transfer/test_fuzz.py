"""Fuzzing the control channel and the notifications of a running TransferServer.

Over 10,000 bad frames go to a real server over a real ZMQ socket: random
bytes, truncated frames, wrong magic or version, valid msgpack of wrong
shapes and types, integers out of range, bad signatures, oversized and
multipart messages. Every one must be refused (a ``Refused`` answer and one
count), the server must keep serving real Hello/Reserve/push/Lookup calls
interleaved with them, and its memory must not grow.
"""

from __future__ import annotations

import hmac
import random
import resource
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import msgspec
import pytest
import zmq

from fabric.store import ChunkStore, StoreConfig
from fabric.store.tier import TieredStore
from fabric.transfer import TransferConfig, TransferNode, TransferServer
from fabric.transfer import protocol as proto
from fabric.transfer.store_client import StoreClient

from .patterns import FINGERPRINT, chunk_bytes, chunk_key

SECRET = "fuzz-secret"
MAX_BYTES = 16 << 10
SLOT = 4096
NUM_FRAMES = 10_500
BATCH = 50
REAL_EVERY = 500
CODEC = proto.Codec(SECRET, MAX_BYTES)

# ------------------------------------------------------------------ frames

VALID: list[proto.Message] = [
    proto.Hello(1, "agent", "loopback", FINGERPRINT, b"desc"),
    proto.Reserve(2, "req", [b"k" * 16, b"j" * 16], [4096, 100], 10_000),
    proto.Cancel(3, "req"),
    proto.Heartbeat(4, "req", 5000),
    proto.Lookup(5, "req", [1, 2, 3, 4, 5], True, 1000),
    proto.Release(6, "req"),
    proto.Clear(7, "memory"),
    proto.Pin(8, [1, 2, 3, 4], True),
    proto.WriteDone("req", [0], [0], [12345]),
]
HUGE = [2**63 - 1, 2**64 - 1, -(2**63), 2**31, -(2**31) - 1, 2**32, -1]


def signed(payload: bytes, version: int = proto.SIGNED_VERSION) -> bytes:
    """``payload`` framed and signed as the codec does: a fresh stamp (so the
    frame reaches the payload decoder, not the replay check), the tag."""
    stamp = struct.pack("<QQ", int(time.time() * 1000), random.getrandbits(64))
    body = struct.pack("<2sH", b"FB", version | proto.FLAG_SIGNED) + stamp + payload
    return body + hmac.digest(SECRET.encode(), body, "sha256")


def random_value(rng: random.Random, depth: int = 0) -> object:
    kind = rng.randrange(9 if depth < 3 else 6)
    if kind == 0:
        return rng.choice([*HUGE, 0, 1, rng.randrange(-1000, 1000)])
    if kind == 1:
        return rng.random() * 10 ** rng.randrange(-5, 300)
    if kind == 2:
        return "".join(chr(rng.randrange(32, 0x2FFF)) for _ in range(rng.randrange(12)))
    if kind == 3:
        return rng.randbytes(rng.randrange(20))
    if kind == 4:
        return rng.choice([None, True, False])
    if kind == 5:
        return rng.choice([m.__struct_config__.tag for m in VALID] + ["", "nope"])
    if kind in (6, 7):
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(8))]
    return {str(random_value(rng, 3)): random_value(rng, depth + 1) for _ in range(3)}


def mutate_fields(rng: random.Random) -> bytes:
    """A real message with one or two fields swapped for random or huge values."""
    fields = msgspec.to_builtins(rng.choice(VALID))
    assert isinstance(fields, list)
    for _ in range(rng.randrange(1, 3)):
        i = rng.randrange(len(fields))
        fields[i] = rng.choice(HUGE) if rng.random() < 0.3 else random_value(rng)
    if rng.random() < 0.2:
        fields = fields[: rng.randrange(len(fields))] or [*fields, 1]
    return proto._encoder.encode(fields)


def fuzz_frame(rng: random.Random) -> tuple[str, bytes]:
    """(category, frame): a frame the server must refuse."""
    kind = rng.randrange(10)
    if kind == 0:
        return "random", rng.randbytes(rng.randrange(0, 200))
    good = CODEC.encode(rng.choice(VALID))
    if kind == 1:
        return "truncated", good[: rng.randrange(len(good))]
    if kind == 2:
        magic = rng.choice([b"BF", b"\x00\x00", b"fb", rng.randbytes(2)])
        return "magic", (magic if magic != b"FB" else b"XX") + good[2:]
    if kind == 3:
        version = rng.choice([0, 1, 3, 0x7FFF, rng.randrange(4, 0x7FFF)])
        return "version", signed(good[20:-32], version)  # NOTE: its stamp replaced
    if kind == 4:
        return "shape", signed(proto._encoder.encode(random_value(rng)))
    if kind in (5, 6):
        return "fields", signed(mutate_fields(rng))
    if kind == 7:
        other = rng.choice([proto.Codec("other-secret"), proto.Codec()])
        tampered = bytearray(good)
        tampered[rng.randrange(4, len(good))] ^= 1 << rng.randrange(8)
        return "signature", rng.choice([other.encode(rng.choice(VALID)), bytes(tampered)])
    if kind == 8:
        return "oversized", signed(b"\x00" * (MAX_BYTES + rng.randrange(1, 900)))
    return "msgpack-garbage", signed(rng.randbytes(rng.randrange(1, 64)))


def must_refuse(rng: random.Random) -> tuple[str, bytes]:
    """A fuzz frame that is really invalid: the local codec cannot decode it,
    or what it decodes to is refused for want of a Hello."""
    while True:
        kind, frame = fuzz_frame(rng)
        try:
            msg = CODEC.decode(frame)
        except proto.ProtocolError:
            return kind, frame
        if isinstance(msg, proto.Reserve | proto.Cancel | proto.Heartbeat | proto.WriteDone):
            return "no-hello", frame


# ------------------------------------------------------------------ fixtures


@dataclass
class Rig:
    server: TransferServer
    receiver: TransferNode
    sender: TransferNode
    store_client: StoreClient
    tier: TieredStore


@pytest.fixture
def rig() -> Iterator[Rig]:
    config = TransferConfig(
        transport="loopback", secret=SECRET, max_message_bytes=MAX_BYTES, poll_interval_ms=0.5
    )
    store = ChunkStore(StoreConfig(slot_bytes=SLOT, num_slots=16, quarantine_ms=10))
    tier = TieredStore(store, chunk_tokens=4, fingerprint=FINGERPRINT)
    receiver = TransferNode(store, config, FINGERPRINT, name="fuzz-receiver", tier=tier)
    sender_store = ChunkStore(StoreConfig(slot_bytes=SLOT, num_slots=4))
    sender = TransferNode(sender_store, config, FINGERPRINT, name="fuzz-sender", serve=False)
    client = StoreClient(receiver.endpoint, secret=SECRET, timeout_ms=5000)
    assert receiver.server is not None
    yield Rig(receiver.server, receiver, sender, client, tier)
    client.close()
    sender.close()
    receiver.close()
    tier.close()


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def counted(server: TransferServer) -> int:
    s = server.stats
    return s.protocol_errors + s.bad_signatures + s.refused


def real_round(rig: Rig, n: int) -> None:
    """A fresh Hello, a Reserve, a push of one chunk, its verification, a Lookup."""
    sender, endpoint = rig.sender, rig.receiver.endpoint
    sender.client.disconnect(endpoint)
    link = sender.client.connect(endpoint)
    key = chunk_key(1000 + n, 0)
    slot = sender.store.allocate(key)
    sender.store.pool.slot_view(slot).numpy()[:] = memoryview(chunk_bytes(1000 + n, 0, SLOT))
    sender.store.commit(slot, key, SLOT)
    link.push(f"real-{n}", [key], [slot], timeout=5)
    prog = rig.server.wait(f"real-{n}", 5)
    assert prog is not None and prog.complete, f"round {n}: {prog}"
    assert rig.receiver.store.lookup([key]) == 1
    rig.server.release(f"real-{n}")
    sender.store.drop_unused()
    assert rig.store_client.lookup(list(range(8))).chunk_tokens == 4


def fuzz_socket(endpoint: str) -> zmq.Socket[bytes]:
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def send_batch(sock: zmq.Socket[bytes], frames: list[tuple[str, bytes]]) -> list[str]:
    """Send frames, collect one reply each; returns the Refused codes in order."""
    for _, frame in frames:
        sock.send(frame)
    codes = []
    for kind, frame in frames:
        assert sock.poll(5000), f"no answer to a {kind} frame {frame[:40]!r}"
        reply = CODEC.decode(sock.recv())
        assert isinstance(reply, proto.Refused), f"{kind} frame {frame[:40]!r} got {reply}"
        codes.append(reply.code)
    return codes


# ------------------------------------------------------------------ tests


def test_control_channel_survives_10k_bad_frames(rig: Rig) -> None:
    rng = random.Random(20_240_601)
    sock = fuzz_socket(rig.receiver.endpoint)
    seen: dict[str, int] = {}
    expected = {"signature": "bad_signature", "no-hello": "no_hello", "oversized": "bad_message"}
    try:
        rss_before = 0.0
        for start in range(0, NUM_FRAMES, BATCH):
            if start % REAL_EVERY == 0:
                real_round(rig, start)
            if start == 1000:
                rss_before = rss_mib()
            frames = [must_refuse(rng) for _ in range(BATCH)]
            before = counted(rig.server)
            codes = send_batch(sock, frames)
            assert counted(rig.server) - before == BATCH
            for (kind, _), code in zip(frames, codes, strict=True):
                seen[kind] = seen.get(kind, 0) + 1
                assert code == expected.get(kind, code), (kind, code)
                assert code in ("bad_message", "bad_signature", "no_hello"), (kind, code)
        real_round(rig, NUM_FRAMES)
        growth = rss_mib() - rss_before
    finally:
        sock.close()
    stats = rig.server.stats
    assert min(seen.values()) >= 30 and len(seen) == 10, seen
    assert stats.internal_errors == 0
    assert stats.oversized == seen["oversized"]
    assert stats.bad_signatures >= seen["signature"]
    assert growth < 20, f"RSS grew {growth:.1f} MiB"
    assert len(rig.server._progress) == 0
    assert len(rig.server._peers) <= NUM_FRAMES // REAL_EVERY + 2


def test_frames_past_the_zmq_cap_drop_only_their_connection(rig: Rig) -> None:
    sock = fuzz_socket(rig.receiver.endpoint)
    try:
        for i in range(5):
            sock.send(b"FB\x01\x80" + b"\x00" * (4 * MAX_BYTES))
            deadline = time.monotonic() + 5
            while rig.server.stats.disconnects < i + 1:
                assert time.monotonic() < deadline, "dropped connection not counted"
                time.sleep(0.01)
            # the same socket reconnects and is answered again
            assert send_batch(sock, [("random", b"junk")]) == ["bad_message"]
        real_round(rig, 0)
    finally:
        sock.close()


def test_multipart_and_empty_messages_are_refused(rig: Rig) -> None:
    sock = fuzz_socket(rig.receiver.endpoint)
    try:
        for parts in ([b"", b""], [b"a", b"b", b"c"], [b""] * 5):
            sock.send_multipart(parts)
            assert sock.poll(5000)
            reply = CODEC.decode(sock.recv())
            assert isinstance(reply, proto.Refused) and reply.code == "bad_message"
        assert send_batch(sock, [("empty", b"")]) == ["bad_message"]
    finally:
        sock.close()
    real_round(rig, 1)


def test_bad_notifications_are_dropped_and_counted(rig: Rig) -> None:
    rng = random.Random(7)
    link = rig.sender.client.connect(rig.receiver.endpoint)
    post: Callable[[bytes], object] = lambda frame: rig.sender.plane.post_write(  # noqa: E731
        link.peer_agent, [], frame
    )
    stats = rig.server.stats
    before = stats.protocol_errors + stats.bad_signatures + stats.late_writes
    sent = 0
    for _ in range(1000):
        _, frame = fuzz_frame(rng)
        if rng.random() < 0.2:  # well signed, for a request nobody reserved
            done = proto.WriteDone(f"ghost-{rng.randrange(9)}", [0], [0], [rng.randrange(2**64)])
            frame = CODEC.encode(done)
        if frame:  # an empty notification is no notification
            post(frame)
            sent += 1
    deadline = time.monotonic() + 10
    while stats.protocol_errors + stats.bad_signatures + stats.late_writes - before < sent:
        assert time.monotonic() < deadline, "notifications not all counted"
        time.sleep(0.01)
    assert stats.chunks_filled == 0 and stats.internal_errors == 0
    assert rig.receiver.store.stats().filled == 0
    real_round(rig, 2)


def well_typed(rng: random.Random, request_ids: list[str]) -> proto.Message:
    """A message that decodes, with values chosen to stress the server's logic."""
    rid = rng.choice(request_ids)
    seq = rng.randrange(2**31)
    kind = rng.randrange(7)
    if kind < 3:
        n = rng.choice([1, 2, 3, 40])
        keys = [rng.choice([b"dup" * 5, rng.randbytes(16), b""]) for _ in range(n)]
        sizes = [rng.choice([0, 1, SLOT, SLOT + 1, 2**62]) for _ in range(rng.choice([n, n + 1]))]
        lease = rng.choice([1, 50, 1000, proto.MAX_LEASE_MS])
        return proto.Reserve(seq, rid, keys, sizes, lease)
    if kind == 3:
        return proto.Cancel(seq, rid)
    if kind == 4:
        return proto.Heartbeat(seq, rid, rng.choice([1, 10_000, proto.MAX_LEASE_MS]))
    if kind == 5:
        tokens = [rng.randrange(-(2**31), 2**31) for _ in range(rng.randrange(0, 20))]
        return proto.Lookup(seq, rid, tokens, rng.random() < 0.5, rng.choice([1, 100]))
    return rng.choice(
        [proto.Release(seq, rid), proto.Clear(seq, rng.choice(["memory", "disk", "all", "x"]))]
    )


def test_well_typed_requests_with_hostile_values(rig: Rig) -> None:
    """A peer that said Hello sends real messages with edge-case values, and
    notifications with bogus indices, generations and checksums."""
    rng = random.Random(99)
    sock = fuzz_socket(rig.receiver.endpoint)
    plane = rig.sender.plane
    link = rig.sender.client.connect(rig.receiver.endpoint)
    request_ids = [f"h-{i}" for i in range(6)]
    try:
        # NOTE: named after another agent than its descriptor's: refused (it
        # would have that agent's cache read into its own slots)
        hello = proto.Hello(1, "fuzzer", "loopback", FINGERPRINT, plane.descriptor())
        sock.send(CODEC.encode(hello))
        assert sock.poll(5000)
        refused = CODEC.decode(sock.recv())
        assert isinstance(refused, proto.Refused) and refused.code == "bad_descriptor"
        hello = proto.Hello(2, plane.name, "loopback", FINGERPRINT, plane.descriptor())
        sock.send(CODEC.encode(hello))
        assert sock.poll(5000) and isinstance(CODEC.decode(sock.recv()), proto.HelloAck)
        for _ in range(2000):
            msg = well_typed(rng, request_ids)
            sock.send(CODEC.encode(msg))
            assert sock.poll(5000), f"no answer to {msg}"
            reply = CODEC.decode(sock.recv())
            assert getattr(reply, "seq", None) == msg.seq, (msg, reply)  # type: ignore[union-attr]
            if rng.random() < 0.3:
                indices = [rng.choice([0, 1, 2, 39, 40, 2**31 - 1]) for _ in range(2)]
                checksums = [rng.randrange(2**64) for _ in indices]
                generations = [rng.randrange(3) for _ in indices]
                done = proto.WriteDone(rng.choice(request_ids), indices, generations, checksums)
                plane.post_write(link.peer_agent, [], CODEC.encode(done))
        for rid in request_ids:
            sock.send(CODEC.encode(proto.Cancel(0, rid)))
            assert sock.poll(5000)
            sock.recv()
    finally:
        sock.close()
    time.sleep(0.2)  # the verifier drains its queue
    stats = rig.server.stats
    assert stats.internal_errors == 0 and stats.chunks_filled == 0
    assert rig.receiver.store.stats().filled == 0
    real_round(rig, 3)
