"""Server/client logic over the in-process loopback data plane (no network)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator

import pytest

from fabric.errors import ConfigError, ReservationRefused, TransferTimeout, TransportFailed
from fabric.store import ChunkStore, StoreConfig
from fabric.transfer import TransferConfig, TransferNode
from fabric.transfer import protocol as proto

from .patterns import FINGERPRINT, chunk_key, fill_store, loop_wakeups

SLOT = 64 << 10
_names = itertools.count()


def make_node(num_slots: int, *, serve: bool) -> TransferNode:
    store = ChunkStore(StoreConfig(slot_bytes=SLOT, num_slots=num_slots, quarantine_ms=10))
    config = TransferConfig(transport="loopback", poll_interval_ms=0.5)
    return TransferNode(store, config, FINGERPRINT, name=f"lb-{next(_names)}", serve=serve)


@pytest.fixture
def pair() -> Iterator[tuple[TransferNode, TransferNode]]:
    sender, receiver = make_node(16, serve=False), make_node(8, serve=True)
    yield sender, receiver
    sender.close()
    receiver.close()


def fill(node: TransferNode, seed: int, n: int) -> tuple[list[bytes], list[int]]:
    return fill_store(node, seed, n, SLOT)


def test_push_lands_verified(pair: tuple[TransferNode, TransferNode]) -> None:
    sender, receiver = pair
    keys, slots = fill(sender, 1, 4)
    sender.client.connect(receiver.endpoint).push("r1", keys, slots, timeout=5)
    assert receiver.server is not None
    prog = receiver.server.wait("r1", 5)
    assert prog is not None and prog.complete
    assert receiver.store.lookup(keys) == 4
    receiver.server.release("r1")
    assert receiver.store.reserved_count() == 0


def test_corrupted_chunk_is_not_indexed(pair: tuple[TransferNode, TransferNode]) -> None:
    sender, receiver = pair
    keys, slots = fill(sender, 2, 2)
    link = sender.client.connect(receiver.endpoint)
    res = link.reserve("r2", keys, [SLOT, SLOT])
    # Corrupt the source after its checksum was taken: the bytes that land
    # no longer match the checksum carried by the notification.
    sender.store.pool.slot_view(slots[1])[100] ^= 0xFF
    link.write(res, range(2), slots).wait(5)
    assert receiver.server is not None
    prog = receiver.server.wait("r2", 5)
    assert prog is not None and prog.failed == {1} and prog.filled == {0}
    assert receiver.store.lookup(keys) == 1
    assert receiver.server.stats.checksum_failures == 1
    receiver.server.release("r2")
    assert receiver.store.reserved_count() == 0


def test_wait_is_bounded_when_nothing_arrives(pair: tuple[TransferNode, TransferNode]) -> None:
    sender, receiver = pair
    link = sender.client.connect(receiver.endpoint)
    link.reserve("r3", [chunk_key(3, 0)], [SLOT], lease_ms=5000)
    assert receiver.server is not None
    prog = receiver.server.wait("r3", 0.1)
    assert prog is not None and not prog.finished
    assert link.cancel("r3")
    assert receiver.store.reserved_count() == 0


def test_refused_when_full_then_serves_again(pair: tuple[TransferNode, TransferNode]) -> None:
    sender, receiver = pair
    link = sender.client.connect(receiver.endpoint)
    keys = [chunk_key(4, i) for i in range(9)]
    with pytest.raises(ReservationRefused, match="capacity"):
        link.reserve("r4", keys, [SLOT] * 9)
    keys, slots = fill(sender, 5, 8)
    link.push("r5", keys, slots, timeout=5)
    assert receiver.server is not None
    assert receiver.server.wait("r5", 5).complete  # type: ignore[union-attr]


def test_unknown_notification_is_counted(pair: tuple[TransferNode, TransferNode]) -> None:
    sender, receiver = pair
    link = sender.client.connect(receiver.endpoint)
    notif = proto.encode(proto.WriteDone("nobody", [0], [0], [0]))
    # NOTE: bare notifications: a write of bytes for nobody is refused whole
    # (notification and all, see test_fencing.py)
    sender.plane.post_write(link.peer_agent, [], notif)
    sender.plane.post_write(link.peer_agent, [], b"not a frame")
    assert receiver.server is not None
    stats = receiver.server.stats
    import time

    deadline = time.monotonic() + 5
    while stats.late_writes < 1 or stats.protocol_errors < 1:
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_write_timeout_is_explicit() -> None:
    from fabric.transfer.client import PendingPush
    from fabric.transfer.dataplane import WriteHandle, XferState

    class Stuck(WriteHandle):
        def poll(self) -> XferState:
            return XferState.PROC

    with pytest.raises(TransferTimeout):
        PendingPush(Stuck(), 10).wait(0.05)


def test_idle_peer_is_forgotten_and_says_hello_again() -> None:
    """A receiver prunes a sender silent past ``peer_idle_s`` (its peer table
    would otherwise grow with every sender restart); the sender's link says
    Hello again by itself on its next reservation."""
    store = ChunkStore(StoreConfig(slot_bytes=SLOT, num_slots=8, quarantine_ms=10))
    config = TransferConfig(transport="loopback", poll_interval_ms=0.5, peer_idle_s=0.2)
    receiver = TransferNode(store, config, FINGERPRINT, name=f"lb-{next(_names)}", serve=True)
    sender = make_node(16, serve=False)
    try:
        assert receiver.server is not None
        keys, slots = fill(sender, 5, 2)
        link = sender.client.connect(receiver.endpoint)
        link.push("idle-1", keys[:1], slots[:1], timeout=5)
        assert receiver.server.wait("idle-1", 5) is not None
        receiver.server.release("idle-1")
        assert receiver.server.stats.hellos == 1
        deadline = time.monotonic() + 5
        while receiver.server.stats.peers_pruned == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert receiver.server.stats.peers_pruned == 1
        assert receiver.server.snapshot()["server_peers_pruned"] == 1
        link.push("idle-2", keys[1:], slots[1:], timeout=5)
        prog = receiver.server.wait("idle-2", 5)
        assert prog is not None and prog.complete
        assert receiver.server.stats.hellos == 2
        receiver.server.release("idle-2")
        assert store.lookup(keys) == 2
    finally:
        sender.close()
        receiver.close()


def test_a_reservation_waiting_for_its_first_write_is_polled_quietly() -> None:
    """A decoder admitted at dispatch holds its reservation through the
    whole prefill before a byte comes: the loop polls every
    quiet_poll_interval_ms then, not every poll_interval_ms (the old code:
    ~3,000 wake-ups a second on an engine's one core). A count, not a time:
    a busy box only makes the loop wake less. The write that then comes
    still lands and verifies."""
    store = ChunkStore(StoreConfig(slot_bytes=SLOT, num_slots=8, quarantine_ms=10))
    config = TransferConfig(transport="loopback")  # NOTE: the default intervals
    receiver = TransferNode(store, config, FINGERPRINT, name=f"lb-{next(_names)}", serve=True)
    sender = make_node(8, serve=False)
    try:
        server = receiver.server
        assert server is not None
        keys, slots = fill(sender, 9, 2)
        link = sender.client.connect(receiver.endpoint)
        res = link.reserve("r-quiet", keys, [SLOT, SLOT])
        time.sleep(0.1)  # NOTE: past QUIET_AFTER_MS since the Reserve
        steps = loop_wakeups(server)
        assert 0 < steps <= 1000 / config.quiet_poll_interval_ms + 50, steps
        link.write(res, range(2), slots).wait(5)
        prog = server.wait("r-quiet", 5)
        assert prog is not None and prog.complete
        server.release("r-quiet")
    finally:
        sender.close()
        receiver.close()


def test_a_quiet_poll_faster_than_the_busy_one_is_refused_naming_the_field() -> None:
    with pytest.raises(ConfigError, match="quiet_poll_interval_ms"):
        TransferConfig(transport="loopback", poll_interval_ms=2.0)
    assert TransferConfig(poll_interval_ms=2.0, quiet_poll_interval_ms=2.0).poll_interval_ms == 2.0


def test_a_route_left_idle_is_loaded_again_before_the_next_write(
    pair: tuple[TransferNode, TransferNode], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A route nothing was written to for ROUTE_IDLE_RELOAD_S (UCX may have
    lost its connection meanwhile) gets a fresh Hello and agent first."""
    from fabric.transfer import client as client_module

    sender, receiver = pair
    assert receiver.server is not None
    link = sender.client.connect(receiver.endpoint)
    keys, slots = fill(sender, 11, 2)
    link.push("r11", keys, slots, timeout=5)
    hellos = receiver.server.stats.hellos
    link.push("r12", *fill(sender, 12, 2), timeout=5)
    assert receiver.server.stats.hellos == hellos  # used a moment ago: kept
    monkeypatch.setattr(client_module, "ROUTE_IDLE_RELOAD_S", 0.0)
    link.push("r13", *fill(sender, 13, 2), timeout=5)
    assert receiver.server.stats.hellos == hellos + 1
    prog = receiver.server.wait("r13", 5)
    assert prog is not None and prog.complete


def test_a_write_refused_because_the_peer_is_gone_reloads_it_and_lands(
    pair: tuple[TransferNode, TransferNode], monkeypatch: pytest.MonkeyPatch
) -> None:
    """NIXL refuses every write to a remote agent it marked disconnected
    (NIXL_ERR_REMOTE_DISCONNECT): the link loads the agent again and
    retries the write once; nothing of the refused one was sent."""
    from fabric.errors import PeerDisconnected

    sender, receiver = pair
    assert receiver.server is not None
    link = sender.client.connect(receiver.endpoint)
    plane = sender.client.plane
    real_post, refusals = plane.post_write, [1]

    def post_write(*args: object, **kw: object) -> object:
        if refusals:
            refusals.pop()
            raise PeerDisconnected("remote agent was disconnected")
        return real_post(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(plane, "post_write", post_write)
    hellos = receiver.server.stats.hellos
    keys, slots = fill(sender, 14, 2)
    link.push("r14", keys, slots, timeout=5)
    assert receiver.server.stats.hellos == hellos + 1 and not refusals
    prog = receiver.server.wait("r14", 5)
    assert prog is not None and prog.complete and receiver.store.lookup(keys) == 2


def test_a_lease_that_ran_out_during_a_reload_posts_no_write(
    pair: tuple[TransferNode, TransferNode], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reload's Hello can take up to ``control_timeout_ms``: the lease is
    checked again after it, and a write whose lease ran out meanwhile is not
    posted (its slots may be another request's by the time it lands)."""
    from fabric.errors import ReservationExpired
    from fabric.transfer import client as client_module

    sender, receiver = pair
    link = sender.client.connect(receiver.endpoint)
    keys, slots = fill(sender, 15, 2)
    res = link.reserve("r15", keys, [SLOT, SLOT])
    monkeypatch.setattr(client_module, "ROUTE_IDLE_RELOAD_S", 0.0)
    hello = link._handshake

    def slow_hello() -> proto.HelloAck:
        ack = hello()
        link._track_lease("r15", time.monotonic() - 1)  # ran out while it waited
        return ack

    monkeypatch.setattr(link, "_handshake", slow_hello)
    with pytest.raises(ReservationExpired):
        link.write(res, range(2), slots)
    pool, source = receiver.store.pool, sender.store.pool
    for mine, theirs in zip(slots, res.slots, strict=True):
        assert bytes(pool.slot_view(theirs)) != bytes(source.slot_view(mine))


def test_a_reload_that_finds_the_receiver_restarted_writes_nothing_there(
    pair: tuple[TransferNode, TransferNode], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The receiver restarted on its endpoint while the route was idle: the
    reload's Hello names a new agent, whose pool never granted the slots of
    the old reservation; the write is refused as expired, every lease of the
    link ends, and not a byte reaches the new receiver's pool."""
    from fabric.errors import ReservationExpired
    from fabric.transfer import client as client_module

    sender, receiver = pair
    link = sender.client.connect(receiver.endpoint)
    keys, slots = fill(sender, 16, 2)
    res = link.reserve("r16", keys, [SLOT, SLOT])
    restarted = make_node(8, serve=True)
    try:
        other = sender.client.connect(restarted.endpoint)
        monkeypatch.setattr(client_module, "ROUTE_IDLE_RELOAD_S", 0.0)
        monkeypatch.setattr(link, "_handshake", other._handshake)
        with pytest.raises(ReservationExpired, match="restarted"):
            link.write(res, range(2), slots)
        assert link.num_leases == 0
        pool, source = restarted.store.pool, sender.store.pool
        for mine, theirs in zip(slots, res.slots, strict=True):
            assert bytes(pool.slot_view(theirs)) != bytes(source.slot_view(mine))
    finally:
        restarted.close()


def test_loopback_reads_registered_memory_and_refuses_the_rest() -> None:
    """The in-process fake of a direct read (NIXL's is in test_direct_read.py)."""
    import numpy as np
    import torch

    from fabric.transfer.dataplane import LoopbackDataPlane

    a, b = LoopbackDataPlane("read-a"), LoopbackDataPlane("read-b")
    pool_a, pool_b = torch.zeros(64, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8)
    src = torch.arange(256, dtype=torch.int32).view(torch.uint8)[:256].clone()
    dst = torch.zeros(256, dtype=torch.uint8)
    try:
        with pytest.raises(TransportFailed, match="pool before"):
            a.register_region(dst.data_ptr(), 256)
        a.register_pool(pool_a.data_ptr(), 64)
        b.register_pool(pool_b.data_ptr(), 64)
        a.register_region(dst.data_ptr(), 256)
        b.register_region(src.data_ptr(), 256)
        peer = a.add_peer(b.descriptor())
        rows = np.array([[dst.data_ptr() + 8, src.data_ptr() + 100, 50]], dtype=np.int64)
        with pytest.raises(TransportFailed, match="outside what"):
            a.post_read(peer, rows)  # NOTE: the descriptor alone opens no region
        with pytest.raises(TransportFailed, match="no such regions"):
            a.add_regions(peer, a.region_descriptor().replace(b"read-a", b"read-b"))
        a.add_regions(peer, b.region_descriptor())
        a.post_read(peer, rows, b"read").poll()
        assert torch.equal(dst[8:58], src[100:150]) and int(dst[:8].sum()) == 0
        assert b.take_notifs() == [("read-a", b"read")]
        with pytest.raises(TransportFailed, match="outside what"):
            a.post_read(peer, np.array([[dst.data_ptr(), src.data_ptr() + 250, 8]]))
        with pytest.raises(TransportFailed, match="registered memory"):
            a.post_read(peer, np.array([[dst.data_ptr() + 250, src.data_ptr(), 8]]))
    finally:
        a.close()
        b.close()


def test_spans_within_refuses_wrapping_zero_and_straddling_spans() -> None:
    import numpy as np

    from fabric.transfer.dataplane import spans_within

    base, n = 1 << 20, 4096
    regions = [(base, n)]

    def inside(addr: int, length: int) -> bool:
        return spans_within(np.array([addr]), np.array([length]), regions)

    assert inside(base, n) and inside(base + 16, n - 16)
    assert not inside(base + 16, 2**63 - base)  # NOTE: addr + length would wrap
    assert not inside(base, 0) and not inside(base, -1)
    assert not inside(base + n - 8, 16) and not inside(base - 8, 16)
    assert not spans_within(np.array([base]), np.array([8]), [(base, 0)])
