"""Real transfers between two OS processes, over NIXL/UCX and the TCP fallback."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
import zmq

from fabric.errors import LayoutMismatch, ReservationExpired, ReservationRefused
from fabric.store import ChunkStore, StoreConfig
from fabric.transfer import PeerLink, PendingPush, TransferConfig, TransferNode
from fabric.transfer import protocol as proto
from fabric.transfer.dataplane import WriteFence
from fabric.transfer.nixl_plane import nixl_available

from .patterns import FINGERPRINT, chunk_bytes, chunk_key

SLOT_BYTES = 4 << 20
PEER_SLOTS = 72
QUARANTINE_MS = 100
PEER_SCRIPT = Path(__file__).with_name("peer.py")

TRANSPORTS = [
    pytest.param("nixl", marks=pytest.mark.skipif(not nixl_available(), reason="no nixl")),
    "tcp",
]


class Peer:
    """The receiver process and its command pipe."""

    def __init__(
        self,
        transport: str,
        *,
        wrap: Callable[[list[str]], list[str]] = list,
        extra: Sequence[str] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        """``extra``: peer.py's optional arguments; ``wrap``: how the argv is
        run (e.g. inside a network namespace)."""
        argv = [sys.executable, str(PEER_SCRIPT), transport]
        argv += [str(PEER_SLOTS), str(SLOT_BYTES), str(QUARANTINE_MS), *extra]
        self.proc = subprocess.Popen(
            wrap(argv),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        try:
            self.endpoint = str(self._read()["endpoint"])
        except BaseException:
            self.proc.kill()
            self.proc.wait()
            raise

    def _read(self) -> dict:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"peer exited with {self.proc.poll()}"
        return json.loads(line)

    def cmd(self, *words: object) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(" ".join(map(str, words)) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def stop(self) -> None:
        with contextlib.suppress(AssertionError, BrokenPipeError, ValueError):
            self.cmd("quit")
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module", params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def peer(transport: str) -> Iterator[Peer]:
    p = Peer(transport)
    yield p
    p.stop()


@pytest.fixture(scope="module")
def node(transport: str) -> Iterator[TransferNode]:
    store = ChunkStore(StoreConfig(slot_bytes=SLOT_BYTES, num_slots=80))
    config = TransferConfig(transport=transport, ucx_net_devices="lo")  # type: ignore[arg-type]
    with TransferNode(store, config, FINGERPRINT, serve=False) as n:
        yield n


@pytest.fixture(scope="module")
def link(node: TransferNode, peer: Peer) -> PeerLink:
    return node.client.connect(peer.endpoint)


def fill_local(store: ChunkStore, seed: int, sizes: list[int]) -> tuple[list[bytes], list[int]]:
    """Pack the pattern of each chunk into a local slot (as the prefiller does)."""
    keys, slots = [], []
    for index, nbytes in enumerate(sizes):
        key = chunk_key(seed, index)
        slot = store.allocate(key)
        store.pool.slot_view(slot)[:nbytes].numpy()[:] = memoryview(
            chunk_bytes(seed, index, nbytes)
        )
        store.commit(slot, key, nbytes)
        keys.append(key)
        slots.append(store.acquire([key])[0])
    return keys, slots


def test_push_256_mib_every_byte_verified(node: TransferNode, link: PeerLink, peer: Peer) -> None:
    seed = 1
    sizes = [SLOT_BYTES] * 65 + [SLOT_BYTES - 12_345]  # 66 chunks, partial last one
    keys, slots = fill_local(node.store, seed, sizes)
    assert sum(sizes) >= 256 << 20
    res = link.reserve("req-big", keys, sizes)
    assert not any(res.already_present)
    pushes = [
        link.write(res, range(i, min(i + 8, len(keys))), slots[i : i + 8])
        for i in range(0, len(keys), 8)
    ]
    for push in pushes:
        push.wait(timeout=60)
    node.store.release_slots(slots)
    out = peer.cmd("wait", "req-big", 60, seed)
    assert out["complete"], out
    assert out["filled"] == len(sizes)
    assert out["bad"] == [] and out["failed"] == []
    assert peer.cmd("stats")["reserved"] == 0


def test_chunks_already_present_are_not_sent_again(
    node: TransferNode, link: PeerLink, peer: Peer
) -> None:
    seed = 2
    keys, slots = fill_local(node.store, seed, [1 << 20] * 4)
    link.push("req-first", keys, slots, timeout=30)
    assert peer.cmd("wait", "req-first", 30, seed)["complete"]
    res = link.reserve("req-second", keys, [1 << 20] * 4)
    assert all(res.already_present)
    push = link.write(res, range(4), slots)
    assert push.nbytes == 0 and push.done()
    assert peer.cmd("wait", "req-second", 5, seed)["complete"]
    node.store.release_slots(slots)


def test_full_pool_is_refused_without_hanging(link: PeerLink, peer: Peer) -> None:
    keys = [chunk_key(3, i) for i in range(PEER_SLOTS + 1)]
    t0 = time.monotonic()
    with pytest.raises(ReservationRefused, match="capacity"):
        link.reserve("req-too-big", keys, [SLOT_BYTES] * len(keys))
    assert time.monotonic() - t0 < 2
    stats = peer.cmd("stats")
    assert stats["reserved"] == 0
    assert stats["server"]["refused"] >= 1


def test_expired_lease_returns_slots_to_the_pool(link: PeerLink, peer: Peer) -> None:
    before = peer.cmd("stats")
    keys = [chunk_key(4, i) for i in range(4)]
    link.reserve("req-abandoned", keys, [SLOT_BYTES] * 4, lease_ms=150)
    assert peer.cmd("stats")["reserved"] == 4
    time.sleep(0.15 + QUARANTINE_MS / 1000 + 0.3)
    after = peer.cmd("stats")
    assert after["reserved"] == 0
    assert after["store"]["quarantined"] == 0
    # The 4 slots are free again (the reservation may have evicted LRU chunks).
    assert after["store"]["free"] >= 4
    assert after["server"]["expired"] == before["server"]["expired"] + 1


def test_cancel_frees_slots_and_a_late_write_is_ignored(
    transport: str, node: TransferNode, link: PeerLink, peer: Peer
) -> None:
    seed = 5
    keys, slots = fill_local(node.store, seed, [1 << 20] * 2)
    res = link.reserve("req-cancelled", keys, [1 << 20] * 2)
    assert link.cancel("req-cancelled")
    stats = peer.cmd("stats")
    assert stats["reserved"] == 0
    with pytest.raises(ReservationExpired, match="write not posted"):
        link.write(res, range(2), slots)  # the sender fences itself
    # A write posted before the cancel, landing after it: as the link would
    # have sent it, bypassing its lease check.
    before = stats["server"]
    pool = node.store.pool
    segments = [
        (pool.slot_offset(s), r * SLOT_BYTES, 1 << 20)
        for s, r in zip(slots, res.slots, strict=True)
    ]
    checksums = [node.store.slot_checksum(s) for s in slots]
    notif = proto.encode(proto.WriteDone("req-cancelled", [0, 1], list(res.generations), checksums))
    fence = WriteFence("req-cancelled", list(res.slots), list(res.generations))
    PendingPush(node.plane.post_write(link.peer_agent, segments, notif, fence), 0).wait(30)
    # TCP refuses the write, notification and all; a NIXL write lands, in
    # slots still quarantined, and its notification is found late
    late, refused = (0, 1) if transport == "tcp" else (2, 0)
    deadline = time.monotonic() + 5
    while True:
        after = peer.cmd("stats")["server"]
        seen = after["late_writes"] - before["late_writes"]
        seen += after["refused_writes"] - before["refused_writes"]
        if seen >= late + refused:
            break
        assert time.monotonic() < deadline, "late write was not detected"
        time.sleep(0.05)
    assert after["refused_writes"] == before["refused_writes"] + refused
    assert after["late_writes"] == before["late_writes"] + late
    assert not link.cancel("req-cancelled")
    node.store.release_slots(slots)


def test_bad_control_messages_are_refused_and_counted(
    node: TransferNode, link: PeerLink, peer: Peer
) -> None:
    before = peer.cmd("stats")["server"]["protocol_errors"]
    good = proto.encode(proto.Cancel(1, "x"))
    frames = [
        b"",
        b"garbage bytes that are not a frame",
        b"FB\x07\x00" + good[4:],  # wrong version
        good[:-1],  # truncated
        b"FB\x01\x00" + b"\x00" * (2 << 20),  # oversized
    ]
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(peer.endpoint)
    try:
        replies = 0
        for frame in frames:
            sock.send(frame)
            if sock.poll(2000):
                reply = proto.decode(sock.recv())
                assert isinstance(reply, proto.Refused) and reply.code == "bad_message"
                replies += 1
        # Not having said Hello, even a well-formed request is refused.
        sock.send(proto.encode(proto.Reserve(9, "r", [b"k" * 16], [1], 1000)))
        assert sock.poll(2000)
        reply = proto.decode(sock.recv())
        assert isinstance(reply, proto.Refused) and reply.code == "no_hello"
    finally:
        sock.close()
    after = peer.cmd("stats")["server"]["protocol_errors"]
    # ZMQ drops frames over MAXMSGSIZE itself (and the connection): counted or
    # not, every other bad frame got an answer and a count.
    assert replies >= len(frames) - 1
    assert after - before >= len(frames) - 1
    # ...and the server still serves a correct push.
    seed = 6
    keys, slots = fill_local(node.store, seed, [1 << 20] * 2)
    link.push("req-after-garbage", keys, slots, timeout=30)
    assert peer.cmd("wait", "req-after-garbage", 30, seed)["complete"]
    node.store.release_slots(slots)


def test_layout_fingerprint_mismatch_is_a_clear_error(transport: str, peer: Peer) -> None:
    store = ChunkStore(StoreConfig(slot_bytes=4096, num_slots=2))
    config = TransferConfig(transport=transport, ucx_net_devices="lo")  # type: ignore[arg-type]
    with (
        TransferNode(store, config, "another-model", serve=False) as other,
        pytest.raises(LayoutMismatch, match="fingerprint"),
    ):
        other.client.connect(peer.endpoint)
