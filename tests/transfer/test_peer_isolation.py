"""A slow or dead receiver stalls only the calls to it; control sockets never
block and never deliver stale requests or replies; per-peer tables are pruned.

Real TransferNodes over real ZMQ sockets, plus a hand-driven ZMQ ROUTER
(:class:`FakeReceiver`) where the test needs to decide when a reply comes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import msgspec
import pytest
import zmq

from fabric.errors import PeerUnreachable
from fabric.launch.process import free_port
from fabric.store import ChunkStore, StoreConfig
from fabric.transfer import TransferConfig, TransferNode, tcp_plane
from fabric.transfer import protocol as proto
from fabric.transfer.dataplane import LoopbackDataPlane, XferState
from fabric.transfer.tcp_plane import TcpDataPlane, TcpDescriptor

from .patterns import FINGERPRINT, fill_store
from .silent import silent_endpoint

SLOT = 4096
KEY = b"k" * 32
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


class FakeReceiver:
    """A ZMQ ROUTER answered by hand, with a loopback data plane to hand out."""

    def __init__(self) -> None:
        self.store = ChunkStore(StoreConfig(slot_bytes=SLOT, num_slots=4))
        self.plane = LoopbackDataPlane(f"fake-{next(_names)}")
        self.plane.register_pool(self.store.pool.base_address, self.store.pool.nbytes)
        self.port = free_port()
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.sock: zmq.Socket[bytes] | None = None
        self.bind()

    def bind(self) -> None:
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(self.endpoint)

    def unbind(self) -> None:
        assert self.sock is not None
        self.sock.close(linger=0)
        self.sock = None

    def recv(self, timeout_s: float = 10) -> tuple[bytes, proto.Message]:
        assert self.sock is not None
        assert self.sock.poll(int(timeout_s * 1000)), "no request arrived"
        identity, frame = self.sock.recv_multipart()
        return identity, proto.decode(frame)

    def reply(self, identity: bytes, msg: proto.Message) -> None:
        assert self.sock is not None
        self.sock.send_multipart([identity, proto.encode(msg)])

    def answer_hello(self) -> None:
        identity, hello = self.recv()
        assert isinstance(hello, proto.Hello)
        descriptor = self.plane.descriptor()
        ack = proto.HelloAck(
            hello.seq, self.plane.name, "loopback", FINGERPRINT, descriptor, SLOT, 4
        )
        self.reply(identity, ack)

    def close(self) -> None:
        if self.sock is not None:
            self.unbind()
        self.plane.close()


@pytest.fixture
def fake() -> Iterator[FakeReceiver]:
    receiver = FakeReceiver()
    yield receiver
    receiver.close()


def reserved(msg: proto.Message, slot: int) -> proto.Reserved:
    assert isinstance(msg, proto.Reserve)
    return proto.Reserved(msg.seq, msg.request_id, [slot], [slot + 100], [False], msg.lease_ms)


@pytest.mark.parametrize("kind", ["nothing", "bare", "router"])
def test_a_silent_endpoint_delays_only_the_thread_connecting_to_it(kind: str) -> None:
    receiver = make_node(serve=True)
    sender = make_node(serve=False, control_timeout_ms=3000)
    with (
        nodes(sender, receiver),
        silent_endpoint(kind) as silent,
        ThreadPoolExecutor(1) as pool,
    ):
        stuck = pool.submit(sender.client.connect, silent)
        time.sleep(0.2)  # NOTE: let it get into its handshake
        keys, slots = fill_store(sender, 1, 1, SLOT)
        sender.client.connect(receiver.endpoint).push("r1", keys, slots, timeout=5)
        assert not stuck.done()  # the push went through while the Hello still waits
        with pytest.raises(PeerUnreachable):
            stuck.result(timeout=30)
        assert receiver.server is not None
        prog = receiver.server.wait("r1", 5)
        assert prog is not None and prog.complete
        assert sender.client.table_sizes()["links"] == 1  # none for the silent one


def test_a_call_after_a_timeout_gets_its_own_answer(fake: FakeReceiver) -> None:
    sender = make_node(serve=False, control_timeout_ms=300)
    with nodes(sender), ThreadPoolExecutor(1) as pool:
        connecting = pool.submit(sender.client.connect, fake.endpoint)
        fake.answer_hello()
        link = connecting.result(timeout=10)
        first = pool.submit(link.reserve, "A", [KEY], [SLOT])
        identity_a, reserve_a = fake.recv()
        with pytest.raises(PeerUnreachable):
            first.result(timeout=10)
        fake.reply(identity_a, reserved(reserve_a, 1))  # the late answer
        second = pool.submit(link.reserve, "B", [KEY], [SLOT])
        identity_b, reserve_b = fake.recv()
        assert isinstance(reserve_b, proto.Reserve) and reserve_b.request_id == "B"
        fake.reply(identity_b, reserved(reserve_b, 2))
        res = second.result(timeout=10)
        assert res.request_id == "B" and res.slots == (2,) and res.generations == (102,)


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
        sender.client.config = dataclasses.replace(sender.client.config, control_timeout_ms=1)
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


def test_a_restarted_receiver_leaves_one_data_plane_peer_and_tables_empty() -> None:
    """A receiver restarted on the same endpoint has a new data-plane agent:
    the link drops the old one. Forgotten requests and a dropped link leave
    no entries behind."""
    port = free_port()
    first = make_node("tcp", serve=True, port=port)
    sender = make_node("tcp", serve=False)
    with nodes(sender):
        keys, slots = fill_store(sender, 2, 2, SLOT)
        link = sender.client.connect(first.endpoint)
        link.push("r1", keys[:1], slots[:1], timeout=5)
        first.close()
        second = make_node("tcp", serve=True, port=port)
        with nodes(second):
            link.push("r2", keys[1:], slots[1:], timeout=5)
            assert second.server is not None
            prog = second.server.wait("r2", 5)
            assert prog is not None and prog.complete
            assert isinstance(sender.plane, TcpDataPlane)
            assert len(sender.plane._senders) == 1  # the old agent's sender went
            assert sender.client.table_sizes() == {"links": 1, "leases": 2, "data_peers": 1}
            link.forget("r1")
            link.forget("r2")
            assert sender.client.table_sizes()["leases"] == 0
            sender.client.disconnect(second.endpoint)
            assert sender.client.table_sizes() == {"links": 0, "leases": 0, "data_peers": 0}


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
