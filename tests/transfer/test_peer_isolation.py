"""A slow or dead receiver stalls only the calls to it; control sockets never
block and never deliver stale requests or replies; per-peer tables are pruned.

Real TransferNodes over real ZMQ sockets, plus a hand-driven ZMQ ROUTER
(:class:`FakeReceiver`) where the test needs to decide when a reply comes.
"""

from __future__ import annotations

import contextlib
import itertools
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import msgspec
import pytest
import zmq

from fabric.errors import PeerUnreachable, TransferError
from fabric.launch.process import free_port
from fabric.store import ChunkStore, StoreConfig
from fabric.transfer import TransferConfig, TransferNode, tcp_plane
from fabric.transfer import protocol as proto
from fabric.transfer.client import PeerLink
from fabric.transfer.dataplane import LoopbackDataPlane, XferState
from fabric.transfer.tcp_plane import TcpDataPlane, TcpDescriptor

from .patterns import FINGERPRINT, fill_store
from .silent import KINDS, SLOT, FakeReceiver, gated_endpoint, silent_endpoint

KEY = b"k" * 32
HANG_S = 30  # NOTE: a guard against hangs, never a bound a test should meet
_names = itertools.count()


def make_node(transport: str = "loopback", *, serve: bool, **config: object) -> TransferNode:
    store = ChunkStore(StoreConfig(slot_bytes=SLOT, num_slots=16, quarantine_ms=10))
    cfg = TransferConfig(transport=transport, **config)  # type: ignore[arg-type]
    name = f"iso-{transport}-{next(_names)}"
    return TransferNode(store, cfg, FINGERPRINT, name=name, serve=serve)


@contextlib.contextmanager
def nodes(*made: TransferNode) -> Iterator[None]:
    try:
        yield
    finally:
        for node in made:
            node.close()


@pytest.fixture
def fake() -> Iterator[FakeReceiver]:
    receiver = FakeReceiver()
    yield receiver
    receiver.close()


def reserved(msg: proto.Message, slot: int) -> proto.Reserved:
    assert isinstance(msg, proto.Reserve)
    return proto.Reserved(msg.seq, msg.request_id, [slot], [slot + 100], [False], msg.lease_ms)


@pytest.mark.parametrize("kind", KINDS)
def test_a_silent_endpoint_delays_only_the_thread_connecting_to_it(kind: str) -> None:
    """A Hello the silent endpoint holds (until the test lets it be refused,
    the control timeout being far longer than the test) delays no call to
    another receiver."""
    receiver = make_node(serve=True)
    sender = make_node(serve=False, control_timeout_ms=120_000)
    with (
        nodes(sender, receiver),
        gated_endpoint(kind) as gate,
        ThreadPoolExecutor(1) as pool,
    ):
        stuck = pool.submit(sender.client.connect, gate.endpoint)
        time.sleep(0.2)  # NOTE: let it get into its handshake (a test without it still holds)
        keys, slots = fill_store(sender, 1, 1, SLOT)
        sender.client.connect(receiver.endpoint).push("r1", keys, slots, timeout=HANG_S)
        assert not stuck.done()  # the push went through while the Hello still waits
        gate.refuse()
        with pytest.raises(TransferError, match="refused the handshake"):
            stuck.result(timeout=HANG_S)
        assert receiver.server is not None
        prog = receiver.server.wait("r1", 5)
        assert prog is not None and prog.complete
        assert sender.client.table_sizes()["links"] == 1  # none for the gated one


@pytest.mark.parametrize("kind", KINDS)
def test_a_hello_to_a_silent_endpoint_fails_unreachable(kind: str) -> None:
    sender = make_node(serve=False, control_timeout_ms=300)
    with nodes(sender), silent_endpoint(kind) as silent:
        with pytest.raises(PeerUnreachable):
            sender.client.connect(silent)
        assert sender.client.table_sizes()["links"] == 0


def connected(fake: FakeReceiver, sender: TransferNode, pool: ThreadPoolExecutor) -> PeerLink:
    connecting = pool.submit(sender.client.connect, fake.endpoint)
    fake.answer_hello()
    return connecting.result(timeout=HANG_S)


def timed_out_reserve(
    fake: FakeReceiver, link: PeerLink, pool: ThreadPoolExecutor
) -> proto.Reserve:
    """Reserve ``A``, left unanswered until the call gave up: what the receiver got."""
    first = pool.submit(link.reserve, "A", [KEY], [SLOT])
    _, reserve_a = fake.recv()
    with pytest.raises(PeerUnreachable):
        first.result(timeout=HANG_S)
    assert isinstance(reserve_a, proto.Reserve)
    return reserve_a


def test_a_call_after_a_timeout_gets_its_own_answer(fake: FakeReceiver) -> None:
    """A late answer to an earlier request that reaches the socket of a
    later call (ahead of that call's own answer) does not answer it."""
    sender = make_node(serve=False, control_timeout_ms=300)
    with nodes(sender), ThreadPoolExecutor(1) as pool:
        link = connected(fake, sender, pool)
        reserve_a = timed_out_reserve(fake, link, pool)
        second = pool.submit(link.reserve, "B", [KEY], [SLOT])
        identity_b, reserve_b = fake.recv()
        assert isinstance(reserve_b, proto.Reserve) and reserve_b.request_id == "B"
        fake.reply(identity_b, reserved(reserve_a, 1))  # the late answer, on B's socket
        fake.reply(identity_b, reserved(reserve_b, 2))
        res = second.result(timeout=HANG_S)
        assert res.request_id == "B" and res.slots == (2,) and res.generations == (102,)


def test_a_cancel_sent_later_says_hello_first_and_its_answers_are_dropped(
    fake: FakeReceiver,
) -> None:
    """After a timeout the link rebuilt its socket (a new identity): a
    Cancel queued then goes with a Hello ahead of it, without waiting; their
    answers, arriving ahead of the next call's, do not answer that call, and
    the HelloAck's agent (a receiver restarted meanwhile) is taken."""
    sender = make_node(serve=False, control_timeout_ms=300)
    restarted = LoopbackDataPlane(f"restarted-{next(_names)}")
    with nodes(sender), ThreadPoolExecutor(1) as pool:
        link = connected(fake, sender, pool)
        timed_out_reserve(fake, link, pool)
        link.cancel_later("A", within_s=HANG_S)
        deadline = time.monotonic() + HANG_S
        while not link.flush():  # NOTE: sent once the new socket's connection is up
            assert time.monotonic() < deadline, "the Cancel never went"
            time.sleep(0.01)
        assert sender.client.table_sizes()["cancels"] == 0
        identity, hello = fake.recv()
        assert isinstance(hello, proto.Hello)
        again, cancel = fake.recv()
        assert again == identity and isinstance(cancel, proto.Cancel)
        assert cancel.request_id == "A"
        second = pool.submit(link.reserve, "B", [KEY], [SLOT])
        again, reserve_b = fake.recv()
        assert again == identity  # NOTE: the receiver knows this socket: no no_hello
        ack = fake.hello_ack(hello)
        fake.reply(identity, msgspec.structs.replace(ack, data_descriptor=restarted.descriptor()))
        fake.reply(identity, proto.Ack(cancel.seq, "A", True))
        fake.reply(identity, reserved(reserve_b, 2))
        assert second.result(timeout=HANG_S).slots == (2,)
        assert link.peer_agent == restarted.name
    restarted.close()


def test_a_cancel_for_a_peer_that_is_down_is_dropped_once_its_time_is_up(
    fake: FakeReceiver,
) -> None:
    """A Cancel queued while the receiver is down waits for nothing and is
    forgotten once its time is up: it is not sent when the receiver is back."""
    sender = make_node(serve=False, control_timeout_ms=300)
    with nodes(sender), ThreadPoolExecutor(1) as pool:
        link = connected(fake, sender, pool)
        fake.unbind()
        time.sleep(0.3)  # NOTE: until the sender's side saw the connection go
        link.cancel_later("A", within_s=0.5)
        deadline = time.monotonic() + HANG_S
        while not link.flush():
            assert time.monotonic() < deadline, "the queued Cancel never expired"
            time.sleep(0.05)
        assert sender.client.table_sizes()["cancels"] == 0
        fake.bind()
        beat = pool.submit(link.heartbeat, "B")
        identity, first = fake.recv()
        assert isinstance(first, proto.Heartbeat) and first.request_id == "B"
        fake.reply(identity, proto.Ack(first.seq, "B", True))
        assert beat.result(timeout=HANG_S)
        link.flush()
        assert fake.sock is not None and not fake.sock.poll(200)  # no Cancel came


def test_a_request_that_timed_out_never_reaches_the_peer_later(fake: FakeReceiver) -> None:
    """The receiver went away and came back on the same endpoint: the
    Reserve that timed out meanwhile must not be delivered then (it would
    hold the receiver's slots for a request nobody writes)."""
    sender = make_node(serve=False, control_timeout_ms=1000)
    with nodes(sender), ThreadPoolExecutor(1) as pool:
        connecting = pool.submit(sender.client.connect, fake.endpoint)
        fake.answer_hello()
        link = connecting.result(timeout=10)
        fake.unbind()
        time.sleep(0.3)  # NOTE: until the sender's side saw the connection go
        with pytest.raises(PeerUnreachable):
            link.reserve("A", [KEY], [SLOT])
        fake.bind()
        second = pool.submit(link.reserve, "B", [KEY], [SLOT])
        identity, first_seen = fake.recv()
        assert isinstance(first_seen, proto.Reserve) and first_seen.request_id == "B"
        fake.reply(identity, reserved(first_seen, 2))
        assert second.result(timeout=10).slots == (2,)


def test_calls_to_a_dead_peer_never_block(fake: FakeReceiver) -> None:
    """More calls than ZMQ's default queue holds (1,000), each timing out:
    none blocks in its send."""
    sender = make_node(serve=False, control_timeout_ms=1000)
    with nodes(sender), ThreadPoolExecutor(1) as pool:
        connecting = pool.submit(sender.client.connect, fake.endpoint)
        fake.answer_hello()
        link = connecting.result(timeout=10)
        fake.unbind()
        sender.client.config = sender.client.config.model_copy(update={"control_timeout_ms": 1})
        failed = []

        def hammer() -> None:
            for i in range(2000):
                with contextlib.suppress(PeerUnreachable):
                    link.heartbeat(f"r{i}")
                    continue
                failed.append(i)

        thread = threading.Thread(target=hammer, daemon=True)
        thread.start()
        thread.join(timeout=120)
        assert not thread.is_alive(), f"a send blocked after {len(failed)} calls"
        assert len(failed) == 2000


def rebind(transport: str, port: int, timeout: float = 5.0) -> TransferNode:
    """A serving node on ``port`` just released by a closed one: ZMQ unbinds
    a closed socket on its I/O thread, a moment after ``close`` returns."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return make_node(transport, serve=True, port=port)
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_a_restarted_receiver_leaves_one_data_plane_peer_and_tables_empty() -> None:
    """A receiver restarted on the same endpoint has a new data-plane agent:
    the link drops the old one and the leases it granted. Forgotten requests
    and a dropped link leave no entries behind."""
    port = free_port()
    first = make_node("tcp", serve=True, port=port)
    sender = make_node("tcp", serve=False)
    with nodes(sender):
        keys, slots = fill_store(sender, 2, 2, SLOT)
        link = sender.client.connect(first.endpoint)
        link.push("r1", keys[:1], slots[:1], timeout=5)
        first.close()
        second = rebind("tcp", port)
        with nodes(second):
            link.push("r2", keys[1:], slots[1:], timeout=5)
            assert second.server is not None
            prog = second.server.wait("r2", 5)
            assert prog is not None and prog.complete
            assert isinstance(sender.plane, TcpDataPlane)
            assert len(sender.plane._senders) == 1  # the old agent's sender went
            # NOTE: r1's lease was the old receiver's: it ended with its agent
            sizes = {"links": 1, "leases": 1, "cancels": 0, "data_peers": 1}
            assert sender.client.table_sizes() == sizes
            link.forget("r1")
            link.forget("r2")
            assert sender.client.table_sizes()["leases"] == 0
            sender.client.disconnect(second.endpoint)
            sizes = {"links": 0, "leases": 0, "cancels": 0, "data_peers": 0}
            assert sender.client.table_sizes() == sizes


def test_a_tcp_connect_that_hangs_fails_the_write(monkeypatch: pytest.MonkeyPatch) -> None:
    """A data-plane peer whose SYNs go unanswered (here: a full accept
    queue) fails the write after CONNECT_TIMEOUT_S instead of holding it."""
    monkeypatch.setattr(tcp_plane, "CONNECT_TIMEOUT_S", 0.5)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    for _ in range(4):
        filler = socket.socket()
        filler.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            filler.connect(("127.0.0.1", port))
        fillers.append(filler)
    store = ChunkStore(StoreConfig(slot_bytes=SLOT, num_slots=2))
    plane = TcpDataPlane(f"tcp-hang-{next(_names)}")
    try:
        plane.register_pool(store.pool.base_address, store.pool.nbytes)
        info = TcpDescriptor("blackhole", "127.0.0.1", port, SLOT)
        peer = plane.add_peer(msgspec.msgpack.encode(info))
        handle = plane.post_write(peer, [(0, 0, 64)], b"")
        deadline = time.monotonic() + 30
        while handle.poll() is XferState.PROC:
            assert time.monotonic() < deadline, "the write hung on its connect"
            time.sleep(0.01)
        assert handle.poll() is XferState.ERR
        assert plane.peer_count() == 1
        plane.remove_peer(peer)
        assert plane.peer_count() == 0
    finally:
        plane.close()
        listener.close()
        for filler in fillers:
            filler.close()


class _Clock:
    """A monotonic clock that moves only when a join waits (see below)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


class _StuckThread:
    """A send thread that never ends: each join waits out its whole timeout."""

    def __init__(self, clock: _Clock) -> None:
        self.clock, self.waited = clock, 0.0

    def join(self, timeout: float | None = None) -> None:
        assert timeout is not None, "an unbounded join"
        self.clock.now += timeout
        self.waited += timeout


def test_close_waits_for_stuck_send_threads_once_not_once_each(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Three peers whose send threads never end (stuck mid-write): close
    waits CLOSE_TIMEOUT_S in all (on a clock that moves only while it waits)."""
    store = ChunkStore(StoreConfig(slot_bytes=SLOT, num_slots=2))
    plane = TcpDataPlane(f"tcp-close-{next(_names)}")
    plane.register_pool(store.pool.base_address, store.pool.nbytes)
    clock = _Clock()
    stuck: list[_StuckThread] = []
    for i in range(3):
        info = TcpDescriptor(f"stuck-{i}", "127.0.0.1", free_port(), SLOT)
        sender = plane._senders[plane.add_peer(msgspec.msgpack.encode(info))]
        stuck.append(_StuckThread(clock))
        real, sender.thread = sender.thread, stuck[-1]  # type: ignore[assignment]
        sender.stop()  # NOTE: the real thread ends; close sees the stuck one
        real.join(timeout=HANG_S)
    monkeypatch.setattr(tcp_plane, "time", clock)
    plane.close()
    assert sum(t.waited for t in stuck) <= tcp_plane.CLOSE_TIMEOUT_S
    assert stuck[0].waited == tcp_plane.CLOSE_TIMEOUT_S  # NOTE: it did wait for them
