"""Control-channel security: HMAC-signed frames, size limits, config plumbing."""

from __future__ import annotations

import contextlib
import hmac
import itertools
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import msgspec
import pytest
import zmq

from fabric.config import parse_topology
from fabric.errors import ConfigError, ProtocolError, ReplayError, SignatureError, TransferError
from fabric.integrations.vllm.config import ConnectorConfig
from fabric.integrations.vllm.worker import FabricWorker
from fabric.store import ChunkStore, StoreConfig
from fabric.store.tier import TieredStore
from fabric.transfer import TransferConfig, TransferNode
from fabric.transfer import protocol as proto
from fabric.transfer.dataplane import WriteFence, XferState
from fabric.transfer.store_client import StoreClient
from fabric.transfer.tcp_plane import TcpDataPlane, TcpDescriptor, TcpWrite

from .patterns import FINGERPRINT, fill_store

SLOT = 4096
SECRET = "s3cret-for-tests"
_names = itertools.count()

# --------------------------------------------------------------- the codec


def test_signed_frame_layout_and_round_trip() -> None:
    codec = proto.Codec(SECRET)
    msg = proto.Reserve(7, "req", [b"k" * 16], [4096], 1000)
    frame = codec.encode(msg)
    magic, version = struct.unpack_from("<2sH", frame)
    assert magic == proto.MAGIC and version == proto.SIGNED_VERSION | proto.FLAG_SIGNED
    # a stamp (wall clock ms, nonce), the same payload, the tag
    sent_ms, _ = struct.unpack_from("<QQ", frame, 4)
    assert abs(sent_ms / 1000 - time.time()) < 60
    assert frame[20:-32] == proto.encode(msg)[4:]
    assert codec.decode(frame) == msg


def test_a_replayed_or_stale_signed_frame_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    sender, receiver = proto.Codec(SECRET), proto.Codec(SECRET)
    frame = sender.encode(proto.Cancel(1, "r"))
    assert receiver.decode(frame) == proto.Cancel(1, "r")
    with pytest.raises(ReplayError, match="replayed"):
        receiver.decode(frame)
    assert receiver.decode(sender.encode(proto.Cancel(1, "r"))) == proto.Cancel(1, "r")
    # a frame captured long ago (or a sender whose clock is far off)
    now = time.time()
    monkeypatch.setattr(proto.time, "time", lambda: now - 2 * proto.REPLAY_WINDOW_S)
    old = sender.encode(proto.Cancel(2, "r"))
    monkeypatch.setattr(proto.time, "time", lambda: now)
    with pytest.raises(ReplayError, match="not in sync"):
        receiver.decode(old)


def test_an_older_releases_signed_frame_is_refused_naming_the_release() -> None:
    body = (
        struct.pack("<2sH", b"FB", 1 | proto.FLAG_SIGNED) + proto.encode(proto.Cancel(1, "r"))[4:]
    )
    frame = body + hmac.digest(SECRET.encode(), body, "sha256")
    with pytest.raises(SignatureError, match="same release"):
        proto.Codec(SECRET).decode(frame)


def test_a_notification_is_not_too_old_but_still_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # NOTE: a notification is stamped when its write is posted and read when it landed
    sender, receiver = proto.Codec(SECRET), proto.Codec(SECRET)
    now = time.time()
    monkeypatch.setattr(proto.time, "time", lambda: now - 2 * proto.REPLAY_WINDOW_S)
    late = sender.encode(proto.Cancel(3, "r"))
    monkeypatch.setattr(proto.time, "time", lambda: now)
    assert receiver.decode(late, fresh=False) == proto.Cancel(3, "r")
    with pytest.raises(ReplayError, match="replayed"):
        receiver.decode(late, fresh=False)


def test_a_full_nonce_cache_narrows_the_window(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(proto, "MAX_NONCES", 3)
    sender, receiver = proto.Codec(SECRET), proto.Codec(SECRET)
    frames = []
    for i in range(5):
        monkeypatch.setattr(proto.time, "time", lambda i=i: 1_000_000.0 + i)
        frames.append(sender.encode(proto.Cancel(i, "r")))
    monkeypatch.setattr(proto.time, "time", lambda: 1_000_005.0)
    for frame in frames[:4]:  # the fourth evicts the first nonce
        receiver.decode(frame)
    with pytest.raises(ReplayError, match="older than the replay cache"):
        receiver.decode(frames[0])  # its nonce is gone, its stamp is not newer than the floor
    assert receiver.decode(frames[4]) == proto.Cancel(4, "r")


def test_a_replayed_control_frame_is_refused_and_counted(
    nodes: Callable[..., TransferNode],
) -> None:
    receiver = nodes(SECRET, serve=True)
    assert receiver.server is not None
    frame = proto.Codec(SECRET).encode(proto.Stats(5))
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(receiver.endpoint)
        replies = []
        for _ in range(2):
            sock.send(frame)
            assert sock.poll(5000)
            replies.append(proto.Codec(SECRET).decode(sock.recv()))
        assert isinstance(replies[0], proto.StatsReply)
        assert isinstance(replies[1], proto.Refused) and replies[1].code == "bad_signature"
        assert "replayed" in replies[1].reason
        assert receiver.server.stats.bad_signatures == 1
    finally:
        sock.close()


def test_unsigned_frames_keep_the_version_1_layout() -> None:
    frame = proto.Codec().encode(proto.Cancel(1, "r"))
    assert frame == proto.encode(proto.Cancel(1, "r"))
    assert struct.unpack_from("<H", frame, 2)[0] == 1


@pytest.mark.parametrize(
    ("encoder", "decoder", "match"),
    [
        (proto.Codec(), proto.Codec(SECRET), "unsigned but this side requires a secret"),
        (proto.Codec(SECRET), proto.Codec(), "signed but this side has no secret"),
        (proto.Codec("other"), proto.Codec(SECRET), "does not match"),
    ],
    ids=["unsigned-to-signed", "signed-to-unsigned", "wrong-secret"],
)
def test_secret_mismatch_is_a_signature_error(
    encoder: proto.Codec, decoder: proto.Codec, match: str
) -> None:
    with pytest.raises(SignatureError, match=match):
        decoder.decode(encoder.encode(proto.Cancel(1, "r")))


def test_tag_is_checked_before_the_payload_is_decoded() -> None:
    codec = proto.Codec(SECRET)
    frame = bytearray(codec.encode(proto.Cancel(1, "r")))
    frame[5] ^= 0x01  # a payload byte: the payload may now be garbage
    with pytest.raises(SignatureError):
        codec.decode(bytes(frame))
    garbage = struct.pack("<2sH", b"FB", proto.SIGNED_VERSION | proto.FLAG_SIGNED) + b"\xc1" * 40
    with pytest.raises(SignatureError):
        codec.decode(garbage)
    with pytest.raises(SignatureError, match="shorter than its stamp and tag"):
        codec.decode(garbage[:20])


def test_codec_refuses_to_build_an_oversized_frame() -> None:
    codec = proto.Codec(SECRET, max_bytes=256)
    with pytest.raises(ProtocolError, match="exceeds limit 256"):
        codec.encode(proto.Reserve(1, "r", [b"k" * 16] * 20, [1] * 20, 1000))


def test_unencodable_values_are_protocol_errors() -> None:
    with pytest.raises(ProtocolError, match="cannot encode"):
        proto.Codec().encode(proto.Lookup(1, "r", [2**70], False, 1000))


@pytest.mark.parametrize(
    "payload",
    [
        ["lookup", 1, "r", [2**31], False, 1000],  # token id outside int32
        ["reserve", 1, "r", [b"k"], [-1], 1000],  # negative size
        ["reserve", 1, "r", [b"k"], [1], 0],  # zero lease
        ["reserve", 1, "r", [b"k"], [1], proto.MAX_LEASE_MS + 1],
        ["write_done", "r", [-1], [0], [0]],
        ["write_done", "r", [0], [0], [-5]],
    ],
)
def test_out_of_range_integers_are_refused_at_decode(payload: list[object]) -> None:
    frame = b"FB\x01\x00" + proto._encoder.encode(payload)
    with pytest.raises(ProtocolError, match="undecodable"):
        proto.decode(frame)


def test_secret_stays_out_of_repr() -> None:
    assert SECRET not in repr(TransferConfig(secret=SECRET))
    assert SECRET not in repr(ConnectorConfig(secret=SECRET))


# --------------------------------------------------------------- live servers


def make_node(secret: str | None, *, serve: bool, transport: str = "loopback") -> TransferNode:
    store = ChunkStore(StoreConfig(slot_bytes=SLOT, num_slots=8, quarantine_ms=10))
    config = TransferConfig(
        transport=transport,  # type: ignore[arg-type]
        secret=secret,
        control_timeout_ms=3000,
        poll_interval_ms=0.5,
    )
    tier = TieredStore(store, chunk_tokens=4, fingerprint=FINGERPRINT) if serve else None
    return TransferNode(
        store, config, FINGERPRINT, name=f"sec-{next(_names)}", serve=serve, tier=tier
    )


@pytest.fixture
def nodes() -> Iterator[Callable[..., TransferNode]]:
    made: list[TransferNode] = []

    def make(secret: str | None, *, serve: bool, transport: str = "loopback") -> TransferNode:
        node = make_node(secret, serve=serve, transport=transport)
        made.append(node)
        return node

    yield make
    for node in made:
        node.close()


def fill(node: TransferNode, seed: int, n: int) -> tuple[list[bytes], list[int]]:
    return fill_store(node, seed, n, SLOT)


@pytest.mark.parametrize("transport", ["loopback", "tcp"])
def test_signed_push_lands(nodes: Callable[..., TransferNode], transport: str) -> None:
    receiver = nodes(SECRET, serve=True, transport=transport)
    sender = nodes(SECRET, serve=False, transport=transport)
    keys, slots = fill(sender, 1, 3)
    sender.client.connect(receiver.endpoint).push("r1", keys, slots, timeout=5)
    assert receiver.server is not None
    prog = receiver.server.wait("r1", 5)
    assert prog is not None and prog.complete
    assert receiver.store.lookup(keys) == 3
    assert receiver.server.stats.bad_signatures == 0


@pytest.mark.parametrize(
    ("receiver_secret", "sender_secret"),
    [(SECRET, "wrong"), (SECRET, None), (None, SECRET)],
    ids=["wrong-secret", "sender-unsigned", "receiver-unsigned"],
)
def test_secret_mismatch_fails_the_handshake_at_once(
    nodes: Callable[..., TransferNode], receiver_secret: str | None, sender_secret: str | None
) -> None:
    receiver = nodes(receiver_secret, serve=True)
    sender = nodes(sender_secret, serve=False)
    started = time.monotonic()
    with pytest.raises(TransferError, match="same transfer secret"):
        sender.client.connect(receiver.endpoint)
    assert time.monotonic() - started < 1.0  # an answer, not the 3 s timeout
    assert receiver.server is not None
    assert receiver.server.stats.bad_signatures == 1
    assert receiver.server.stats.hellos == 0


def test_badly_signed_notification_is_dropped(nodes: Callable[..., TransferNode]) -> None:
    receiver = nodes(SECRET, serve=True)
    sender = nodes(SECRET, serve=False)
    keys, slots = fill(sender, 2, 1)
    link = sender.client.connect(receiver.endpoint)
    res = link.reserve("r2", keys, [SLOT])
    segment = [(sender.store.pool.slot_offset(slots[0]), res.slots[0] * SLOT, SLOT)]
    checksum = sender.store.slot_checksum(slots[0])
    assert checksum is not None
    done = proto.WriteDone("r2", [0], list(res.generations), [checksum])
    fence = WriteFence("r2", list(res.slots), list(res.generations))
    for codec in (proto.Codec("wrong"), proto.Codec()):
        sender.plane.post_write(link.peer_agent, segment, codec.encode(done), fence)
    assert receiver.server is not None
    stats = receiver.server.stats
    deadline = time.monotonic() + 5
    while stats.bad_signatures < 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert receiver.store.lookup(keys) == 0  # the bytes landed, but nobody vouched for them
    prog = receiver.server.progress("r2")
    assert prog is not None and not prog.landed
    # the same write with a good signature is accepted
    sender.plane.post_write(link.peer_agent, segment, sender.client.codec.encode(done), fence)
    assert receiver.server.wait("r2", 5).complete  # type: ignore[union-attr]


def test_store_client_signs_and_checks(nodes: Callable[..., TransferNode]) -> None:
    receiver = nodes(SECRET, serve=True)
    with StoreClient(receiver.endpoint, secret=SECRET, timeout_ms=3000) as good:
        assert good.lookup(list(range(8))).hit_chunks == 0
        assert good.clear("memory") == 0
    for secret in ("wrong", None):
        with StoreClient(receiver.endpoint, secret=secret, timeout_ms=3000) as bad:
            started = time.monotonic()
            with pytest.raises(TransferError, match="same transfer secret"):
                bad.lookup(list(range(8)))
            assert time.monotonic() - started < 1.0
    assert receiver.server is not None
    assert receiver.server.stats.bad_signatures == 2


def _raw_socket(endpoint: str) -> zmq.Socket[bytes]:
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def test_oversized_frames_are_counted_and_never_stop_the_server(
    nodes: Callable[..., TransferNode],
) -> None:
    receiver = nodes(None, serve=True)
    assert receiver.server is not None
    stats, limit = receiver.server.stats, receiver.config.max_message_bytes
    sock = _raw_socket(receiver.endpoint)
    try:
        # just over the limit: the codec refuses it with an answer
        sock.send(b"FB\x01\x00" + b"\x00" * limit)
        assert sock.poll(3000)
        reply = proto.decode(sock.recv())
        assert isinstance(reply, proto.Refused) and reply.code == "bad_message"
        assert stats.oversized == 1
        # far over it: ZMQ drops the frame unread, with its connection
        sock.send(b"\x00" * (4 * limit))
        deadline = time.monotonic() + 5
        while stats.disconnects < 1:
            assert time.monotonic() < deadline, "dropped connection not counted"
            time.sleep(0.01)
        # the socket reconnects and is served again
        sock.send(proto.encode(proto.Lookup(1, "x", [1, 2], False, 1000)))
        assert sock.poll(3000)
        assert isinstance(proto.decode(sock.recv()), proto.LookupResult)
    finally:
        sock.close()


def test_multipart_messages_get_an_answer(nodes: Callable[..., TransferNode]) -> None:
    receiver = nodes(None, serve=True)
    sock = _raw_socket(receiver.endpoint)
    try:
        sock.send_multipart([b"a", b"b"])
        assert sock.poll(3000)
        reply = proto.decode(sock.recv())
        assert isinstance(reply, proto.Refused) and "2 message parts" in reply.reason
    finally:
        sock.close()


def test_tcp_data_plane_refuses_unsigned_writes() -> None:

    store = ChunkStore(StoreConfig(slot_bytes=SLOT, num_slots=2))
    plane = TcpDataPlane(f"tcp-sec-{next(_names)}", secret=SECRET)
    try:
        plane.register_pool(store.pool.base_address, store.pool.nbytes)
        info = msgspec.msgpack.decode(plane.descriptor(), type=TcpDescriptor)
        header = msgspec.msgpack.encode(TcpWrite("intruder", [(0, 16)], b"notif"))
        for tag in (b"", b"\x00" * 32):
            with socket.create_connection((info.host, info.port), timeout=5) as sock:
                sock.sendall(struct.pack("<I", len(header)) + header + tag + b"\xff" * 48)
                with contextlib.suppress(ConnectionResetError):  # reset: payload unread
                    assert sock.recv(1) == b""  # closed on us
        deadline = time.monotonic() + 5
        while plane.bad_frames < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert bytes(store.pool.memoryview(0, 16)) == bytes(16) and not plane.take_notifs()
    finally:
        plane.close()


# --------------------------------------------------------------- plumbing


def test_connector_config_reads_the_secret_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FABRIC_TEST_SECRET", SECRET)
    config = ConnectorConfig.from_extra({"secret_env": "FABRIC_TEST_SECRET", "kv_port": 0})
    assert config.resolved_secret() == SECRET
    assert ConnectorConfig.from_extra({"secret": "inline"}).resolved_secret() == "inline"
    assert ConnectorConfig.from_extra({}).resolved_secret() is None
    worker = SimpleNamespace(config=config, tp_rank=0)
    transfer = FabricWorker._transfer_config(worker, True)  # type: ignore[arg-type]
    assert transfer.secret == SECRET and transfer.host == "127.0.0.1"


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"secret_env": "FABRIC_TEST_UNSET_VARIABLE"}, "is not set"),
        ({"secret": "a", "secret_env": "HOME"}, "not both"),
        ({"secret": ""}, "must not be empty"),
    ],
)
def test_bad_secret_settings_are_config_errors(extra: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ConnectorConfig.from_extra(extra)


def test_topology_passes_secret_env_to_engines_and_proxy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    data = {
        "prefill": [{"url": "http://127.0.0.1:9001"}],
        "decode": [{"url": "http://127.0.0.1:9002", "kv_port": 9003}],
        "connector": {"secret_env": "FABRIC_TEST_SECRET"},
    }
    topology = parse_topology(data, source="test")
    assert topology.connector.extra_config(9003)["secret_env"] == "FABRIC_TEST_SECRET"
    monkeypatch.delenv("FABRIC_TEST_SECRET", raising=False)
    with pytest.raises(ConfigError, match="FABRIC_TEST_SECRET"):
        topology.connector.secret()
    monkeypatch.setenv("FABRIC_TEST_SECRET", SECRET)
    assert topology.connector.secret() == SECRET
    from fabric.router import create_app

    assert create_app(topology).state.proxy.store_secret == SECRET
    with pytest.raises(ConfigError, match="secret_env"):
        parse_topology({**data, "connector": {"secret_env": "not a name"}}, source="test")


class _Tamperer:
    """A TCP relay in front of a data plane that flips one payload byte of each
    frame it forwards (after the header and its tag), or none."""

    def __init__(self, upstream: tuple[str, int], flip: bool) -> None:
        self.upstream, self.flip = upstream, flip
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        with contextlib.suppress(OSError):
            conn, _ = self.listener.accept()
            with conn, socket.create_connection(self.upstream, timeout=5) as out:
                seen, target, head = 0, -1, bytearray()
                while chunk := bytearray(conn.recv(1 << 16)):
                    if target < 0:
                        head += chunk[: 4 - len(head)]
                        if len(head) == 4:  # payload byte 10, past the header and its tag
                            target = 4 + struct.unpack("<I", head)[0] + 32 + 10
                    if self.flip and seen <= target < seen + len(chunk):
                        chunk[target - seen] ^= 0xFF
                    seen += len(chunk)
                    out.sendall(chunk)

    def close(self) -> None:
        self.listener.close()
        self.thread.join(timeout=10)


FRAME_PAYLOAD = 3 * 1024


@pytest.mark.parametrize("flip", [False, True])
def test_tcp_data_plane_refuses_a_payload_changed_in_transit(flip: bool) -> None:
    receiver_store = ChunkStore(StoreConfig(slot_bytes=SLOT, num_slots=2))
    sender_store = ChunkStore(StoreConfig(slot_bytes=SLOT, num_slots=2))
    receiver = TcpDataPlane(f"tcp-sec-{next(_names)}", secret=SECRET)
    sender = TcpDataPlane(f"tcp-sec-{next(_names)}", secret=SECRET)
    tamperer: _Tamperer | None = None
    try:
        receiver.register_pool(receiver_store.pool.base_address, receiver_store.pool.nbytes)
        sender.register_pool(sender_store.pool.base_address, sender_store.pool.nbytes)
        payload = bytes(range(256)) * (FRAME_PAYLOAD // 256)
        sender_store.pool.memoryview(0, FRAME_PAYLOAD)[:] = payload
        info = msgspec.msgpack.decode(receiver.descriptor(), type=TcpDescriptor)
        tamperer = _Tamperer((info.host, info.port), flip)
        relayed = TcpDescriptor(info.name, "127.0.0.1", tamperer.port, info.pool_nbytes)
        peer = sender.add_peer(msgspec.msgpack.encode(relayed))
        handle = sender.post_write(peer, [(0, 0, FRAME_PAYLOAD)], b"notif")
        deadline = time.monotonic() + 10
        while handle.poll() is XferState.PROC:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        deadline = time.monotonic() + 10
        while not (receiver.bad_frames or receiver._notifs):
            assert time.monotonic() < deadline, "the write neither landed nor was refused"
            time.sleep(0.01)
        if flip:  # NOTE: the bytes landed, but nothing vouches for them
            assert receiver.take_notifs() == [] and receiver.bad_frames == 1
        else:
            assert receiver.take_notifs() == [(sender.name, b"notif")]
            assert bytes(receiver_store.pool.memoryview(0, FRAME_PAYLOAD)) == payload
    finally:
        sender.close()
        receiver.close()
        if tamperer is not None:
            tamperer.close()
