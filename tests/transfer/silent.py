"""Receivers that never answer (or answer by hand), for tests of what a sender does about them.

``nothing``: a free port nobody listens on (a dead host). ``bare``: a TCP
listener that accepts every connection and never reads or writes a byte
(no ZMTP handshake). ``router``: a ZMQ ROUTER that completes the handshake
and never replies (a hung server).

:func:`gated_endpoint` is one of them that stays silent until the test
calls :meth:`Gate.refuse`: from then on a ROUTER on the same port answers
every request (those already waiting too, for ``router``) with ``Refused``.
A sender with a control timeout longer than the test then fails its calls
to it exactly when the test says so, never because the test ran slowly.

:class:`FakeReceiver` is a ZMQ ROUTER the test answers by hand, with a
loopback data plane to hand out.
"""

from __future__ import annotations

import contextlib
import itertools
import socket
import threading
from collections.abc import Iterator

import zmq

from fabric.launch.process import free_port
from fabric.store import ChunkStore, StoreConfig
from fabric.transfer import protocol as proto
from fabric.transfer.dataplane import LoopbackDataPlane

from .patterns import FINGERPRINT

KINDS = ["nothing", "bare", "router"]
SLOT = 4096
_names = itertools.count()


@contextlib.contextmanager
def silent_endpoint(kind: str) -> Iterator[str]:
    """``tcp://127.0.0.1:PORT`` of a receiver of ``kind`` (see the module docstring)."""
    with gated_endpoint(kind) as gate:
        yield gate.endpoint


@contextlib.contextmanager
def gated_endpoint(kind: str) -> Iterator[Gate]:
    """A receiver of ``kind``, silent until :meth:`Gate.refuse`."""
    gate = Gate(kind)
    try:
        yield gate
    finally:
        gate.close()


class Gate:
    """A silent receiver of one kind that the test turns into a refusing one."""

    def __init__(self, kind: str) -> None:
        if kind not in KINDS:
            raise ValueError(kind)
        self.kind = kind
        self._bare: _BareListener | None = None
        self._router: zmq.Socket[bytes] | None = None
        if kind == "nothing":
            self.port = free_port()
        elif kind == "bare":
            self._bare = _BareListener()
            self.port = self._bare.port
        else:
            self._router = zmq.Context.instance().socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            self.port = self._router.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.refused = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def refuse(self) -> None:
        """From now on answer every request, waiting ones first, with ``Refused``."""
        assert self._thread is None, "refusing already"
        if self._bare is not None:
            self._bare.close()  # NOTE: its connections drop; the sender reconnects to us
            self._bare = None
        if self._router is None:
            self._router = zmq.Context.instance().socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            self._router.bind(self.endpoint)
        self._thread = threading.Thread(target=self._answer, args=(self._router,), daemon=True)
        self._thread.start()  # NOTE: the socket is the thread's from here on

    def _answer(self, router: zmq.Socket[bytes]) -> None:
        while not self._stop.is_set():
            if not router.poll(50):
                continue
            identity, frame = router.recv_multipart()
            seq = getattr(proto.decode(frame), "seq", -1)
            router.send_multipart([identity, proto.encode(proto.Refused(seq, "", "gated", "no"))])
            self.refused += 1

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._router is not None:
            self._router.close(linger=0)
        if self._bare is not None:
            self._bare.close()


class _BareListener:
    """Accepts connections and holds them open, never reading a byte."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._conns: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            self._conns.append(conn)  # NOTE: held open, never read

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self._thread.join(timeout=5)
        for conn in self._conns:
            conn.close()


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

    def hello_ack(self, hello: proto.Message) -> proto.HelloAck:
        assert isinstance(hello, proto.Hello)
        descriptor = self.plane.descriptor()
        return proto.HelloAck(
            hello.seq, self.plane.name, "loopback", FINGERPRINT, descriptor, SLOT, 4
        )

    def answer_hello(self) -> bytes:
        """Answer the next request, a Hello; returns the sender's identity."""
        identity, hello = self.recv()
        self.reply(identity, self.hello_ack(hello))
        return identity

    def close(self) -> None:
        if self.sock is not None:
            self.unbind()
        self.plane.close()
