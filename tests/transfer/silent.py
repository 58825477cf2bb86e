"""Receivers that never answer, for tests of what a sender does about them.

``nothing``: a free port nobody listens on (a dead host). ``bare``: a TCP
listener that accepts every connection and never reads or writes a byte
(no ZMTP handshake). ``router``: a ZMQ ROUTER that completes the handshake
and never replies (a hung server).
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

import zmq

from fabric.launch.process import free_port

KINDS = ["nothing", "bare", "router"]


@contextlib.contextmanager
def silent_endpoint(kind: str) -> Iterator[str]:
    """``tcp://127.0.0.1:PORT`` of a receiver of ``kind`` (see the module docstring)."""
    if kind == "nothing":
        yield f"tcp://127.0.0.1:{free_port()}"
    elif kind == "bare":
        with _bare_listener() as port:
            yield f"tcp://127.0.0.1:{port}"
    elif kind == "router":
        sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        try:
            yield f"tcp://127.0.0.1:{port}"
        finally:
            sock.close(linger=0)
    else:
        raise ValueError(kind)


@contextlib.contextmanager
def _bare_listener() -> Iterator[int]:
    listener = socket.create_server(("127.0.0.1", 0))
    conns: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            conns.append(conn)  # NOTE: held open, never read

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        with contextlib.suppress(OSError):
            listener.shutdown(socket.SHUT_RDWR)
        listener.close()
        thread.join(timeout=5)
        for conn in conns:
            conn.close()
